"""LMDB 0.9's data file, read with ``pread`` and checked, without LMDB: :mod:`.format` (the meta
page, page header and node by ``mdb.c``'s names), :mod:`.check` (every page check, once, over
arrays of pages), :mod:`.tree` (the walk in key order), :mod:`.places` (a cold read's descent to
a few keys' values), :mod:`.advice` (what is asked of the kernel). It imports nothing from
fastdata: numpy and the standard library only.

LMDB maps its file and follows the page numbers it finds there: a file cut short or a damaged
page makes it touch memory past the end of the file, which ends the process (SIGBUS, SIGSEGV,
or an assertion) instead of raising an error. So a file is checked here before LMDB maps it, and
a full check walks every page here, where damage is a reason and not a fault.
"""

from .check import NotRegular, Truncated, Unreadable, check_file
from .format import FormatError, Header
from .places import value_places
from .tree import Damage, Leaves, Tree, walk

__all__ = [
    "Damage",
    "FormatError",
    "Header",
    "Leaves",
    "NotRegular",
    "Tree",
    "Truncated",
    "Unreadable",
    "check_file",
    "value_places",
    "walk",
]
