"""A data-parallel job killed and restarted in another shape, again and again, and the proof that
every sample of every epoch was delivered exactly once.

``python -m tests.elastic WORKDIR --cycles N --seed S`` runs jobs of ``--epochs`` epochs over a
small LMDB store (each record its own class, so a batch's labels are its records). Each job runs
in segments: a segment forks 1 to 4 ranks (``torch.distributed`` over gloo, on the CPU) from this
process, each with a ``create_loader`` of a random batch size and 0 to 4 workers, resuming from
the last checkpoint; after a random time every rank is SIGKILLed (its workers with it), some
times after an append to the store. Each step, every rank logs the records of the batch it was
handed, all ranks meet at a barrier, and rank 0 saves ``loader.state_dict()`` (written aside,
then renamed): deliveries a checkpoint covers are the job's; later ones are lost with the kill.

When a job ends, its deliveries are followed back from its last segment through the
checkpoints each segment resumed from, and each epoch must hold every record the store had
when the epoch began exactly once, but for the padding of the epoch's last step (at most
``world_size - 1`` records again, the start of the rest that step split: stated by the
sampler), and no record added later. Prints one JSON line per job, and a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from fastdata import LMDBImageDataset, convert, create_loader
from fastdata.images.synthetic import synthetic_jpeg

IMAGE = synthetic_jpeg(32, 32, seed=3)


def add_records(job: Path, start: int, count: int) -> None:
    """Records ``start .. start+count-1`` into the job's store (an append after the first),
    each of its own class ``c<index>``, so that its label is its index."""
    source = job / f"src-{start}"
    for i in range(start, start + count):
        folder = source / f"c{i:06d}"
        folder.mkdir(parents=True)
        (folder / "0.jpg").write_bytes(IMAGE[:2] + b"\xff\xfe\x00\x06" + i.to_bytes(4) + IMAGE[2:])
    if start:  # (an append takes a folder holding the store's classes and the new ones)
        whole = job / "src-all"
        whole.mkdir(exist_ok=True)
        for folder in source.iterdir():
            folder.rename(whole / folder.name)
        convert(whole, job / "store.lmdb", append=True, workers=1)
    else:
        source.rename(job / "src-all")
        convert(job / "src-all", job / "store.lmdb", workers=1)


def rank_main(rank: int, world: int, shape: dict[str, Any], job: Path, segment: int) -> None:
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore", message="This DataLoader will create")  # (2 CPUs here)
    dist.init_process_group(
        "gloo", init_method=f"file://{job}/init-{segment}", rank=rank, world_size=world
    )
    dataset = LMDBImageDataset(job / "store.lmdb")
    loader = create_loader(
        dataset,
        shape["batch"],
        image_size=8,
        num_workers=shape["workers"],
        device="cpu",
        seed=11,
        drop_last=False,
        persistent_workers=False,
        distributed=True,
    )
    checkpoint = job / "checkpoint.json"
    if checkpoint.exists():
        loader.load_state_dict(json.loads(checkpoint.read_text())["state"])
    log = os.open(job / f"log-{segment}-{rank}", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    step = 0
    while loader.position().epoch < shape["epochs"]:
        where = loader.position()
        if rank == 0:
            begin = {
                "begin": where.epoch,
                "at": where.position,
                "of": where.samples,
                "w": world,
                "step": step,
            }
            os.write(log, (json.dumps(begin) + "\n").encode())
        for _, labels in loader:
            step += 1
            epoch = loader.position().epoch
            line = {"step": step, "epoch": epoch, "records": labels.tolist()}
            os.write(log, (json.dumps(line) + "\n").encode())
            dist.barrier()
            if rank == 0:
                saved = {"segment": segment, "step": step, "state": loader.state_dict()}
                (job / "checkpoint.tmp").write_text(json.dumps(saved))
                os.replace(job / "checkpoint.tmp", checkpoint)
            dist.barrier()
    if rank == 0:
        (job / "done").write_text(str(segment))
    dist.barrier()
    loader.close()
    dist.destroy_process_group()


def run_segment(job: Path, segment: int, shape: dict[str, Any], kill_after: float | None) -> bool:
    """One segment's ranks, forked from here, SIGKILLed after ``kill_after`` seconds (None:
    run to the end); whether the job finished."""
    pids = []
    for rank in range(shape["world"]):
        pid = os.fork()
        if pid == 0:
            os.setpgid(0, 0)  # (the rank and its loader's workers: one group, killed together)
            code = 0
            try:
                rank_main(rank, shape["world"], shape, job, segment)
            except BaseException as exc:  # noqa: BLE001 -- reported, then the child ends
                print(f"rank {rank} of segment {segment}: {exc!r}", file=sys.stderr, flush=True)
                code = 1
            finally:
                os._exit(code)
        pids.append(pid)
    deadline = None if kill_after is None else time.monotonic() + kill_after
    failed = []
    alive = set(pids)
    while alive:
        if deadline is not None and time.monotonic() >= deadline:
            for pid in alive:
                _kill(pid)
        for pid in list(alive):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                alive.discard(pid)
                if os.waitstatus_to_exitcode(status) > 0:
                    failed.append(pid)
                _kill(pid)  # (its workers, if any are left)
        time.sleep(0.01)
    if failed:
        raise RuntimeError(f"segment {segment} of {job}: {len(failed)} rank(s) failed")
    return (job / "done").exists()


def _kill(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def check_job(job: Path) -> dict[str, Any]:
    """The job's deliveries, kept as its checkpoints say, against every epoch's records: those
    the store held when the segment that began the epoch started. Raises AssertionError on a
    record lost, delivered twice, or not of the epoch."""
    segments = json.loads((job / "segments.json").read_text())
    segment = int((job / "done").read_text())
    kept: list[tuple[int, int]] = [(segment, 1 << 62)]  # (segment, last step kept)
    while segments[str(segment)]["from"] is not None:
        segment, step = segments[str(segment)]["from"]
        kept.append((segment, step))
    per_epoch: dict[int, Counter[int]] = {}
    first: dict[int, int] = {}  # the records of each epoch, as the store held them
    padding: dict[int, int] = {}
    for segment, upto in reversed(kept):
        for path in sorted(job.glob(f"log-{segment}-*")):
            for raw in path.read_text().splitlines():
                item = json.loads(raw)
                if "begin" in item and item["step"] < upto:  # (a step after it was kept)
                    epoch, rest, world = item["begin"], item["of"] - item["at"], item["w"]
                    if item["at"] == 0:
                        held = segments[str(segment)]["records"]
                        assert epoch not in first and item["of"] == held, (job, item, held)
                        first[epoch] = held
                    if rest:  # (an iteration with nothing left delivers nothing)
                        padding[epoch] = -(-rest // world) * world - rest
                elif "records" in item and item["step"] <= upto:
                    per_epoch.setdefault(item["epoch"], Counter()).update(item["records"])
    for epoch, counts in per_epoch.items():
        n = first[epoch]
        assert set(counts) == set(range(n)), (
            f"{job}: epoch {epoch}: missing {sorted(set(range(n)) - set(counts))[:10]}, "
            f"past its {n} records {sorted(set(counts) - set(range(n)))[:10]}"
        )
        twice = sum(counts.values()) - n
        assert twice == padding[epoch], (
            f"{job}: epoch {epoch}: {twice} deliveries twice, the padding is {padding[epoch]}: "
            f"{[r for r, c in counts.items() if c > 1][:10]}"
        )
    return {"epochs": sorted(per_epoch), "records": [first[e] for e in sorted(first)]}


def run_job(job: Path, rng: random.Random, epochs: int, kills: int) -> tuple[int, dict[str, Any]]:
    """A job killed ``kills`` times (then run to its end); the segments it took, and what
    :func:`check_job` found."""
    job.mkdir(parents=True)
    count = rng.randint(100, 300)
    add_records(job, 0, count)
    segments: dict[str, Any] = {}
    segment = 0
    while True:
        final = segment >= kills
        shape = {
            "world": rng.randint(1, 4),
            "workers": rng.choice([0, 0, 1, 2, 3, 4]),
            "batch": rng.randint(1, 9),
            "epochs": epochs,
        }
        checkpoint = job / "checkpoint.json"
        saved = json.loads(checkpoint.read_text()) if checkpoint.exists() else None
        origin = None if saved is None else [saved["segment"], saved["step"]]
        segments[str(segment)] = {"from": origin, "records": count, **shape}
        (job / "segments.json").write_text(json.dumps(segments))
        kill_after = None if final else rng.uniform(0.05, 1.0)
        if run_segment(job, segment, shape, kill_after):
            break
        segment += 1
        if not final and rng.random() < 0.3:  # an append while the job is down
            more = rng.randint(1, 12)
            add_records(job, count, more)
            count += more
    return segment + 1, check_job(job)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--cycles", type=int, default=20, help="kills and restarts, in all")
    parser.add_argument("--seconds", type=float, default=0, help="stop starting jobs after this")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    args.workdir = args.workdir.resolve()  # (gloo's file:// address takes an absolute path)
    rng = random.Random(args.seed)
    started = time.monotonic()
    done = jobs = 0
    while done < args.cycles:
        if args.seconds and time.monotonic() - started > args.seconds:
            break
        kills = min(args.cycles - done, rng.randint(2, 8))
        segments, found = run_job(args.workdir / f"job-{jobs}", rng, args.epochs, kills)
        done += segments - 1
        jobs += 1
        print(json.dumps({"job": jobs, "kills": segments - 1, **found}), flush=True)
    print(
        json.dumps({"jobs": jobs, "kills": done, "seconds": round(time.monotonic() - started, 1)}),
        flush=True,
    )


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
