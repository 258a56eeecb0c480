"""The records gathered for one commit (:class:`Batch`): the one commit loop of every writing
verb, over any :class:`~fastdata.stores.policy.StoreWriter`."""

from __future__ import annotations

from ..records import Progress, Record
from .policy import StoreWriter

__all__ = ["Batch"]


class Batch:
    """The records gathered for one commit: the one commit loop of every writing verb.

    ``add`` records, ``commit_if_full`` after each (a batch is committed, together with the
    progress ``state``, once it holds ``max_records`` records or ``max_bytes`` image bytes: the
    writer's memory stays flat), and ``commit`` the rest at the end. The writer owns what a commit
    is; the verb only says what goes in it.
    """

    def __init__(
        self, writer: StoreWriter, state: Progress, max_records: int, max_bytes: int
    ) -> None:
        self.writer, self.state = writer, state
        self.max_records, self.max_bytes = max_records, max_bytes
        self.records: list[Record] = []
        self.nbytes = 0

    def add(self, record: Record) -> None:
        self.records.append(record)
        self.nbytes += len(record.data)

    def __len__(self) -> int:
        return len(self.records)

    def commit_if_full(self) -> None:
        if len(self.records) >= self.max_records or self.nbytes >= self.max_bytes:
            self.commit()

    def commit(self) -> None:
        """Commit what was added (and the progress with it), even nothing: an empty commit
        saves the progress alone."""
        records, self.records, self.nbytes = self.records, [], 0
        self.writer.write(records, self.state)
