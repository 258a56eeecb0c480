#!/usr/bin/env python
"""Train a compact CNN on a store through create_loader: a complete, resumable example.

    python scripts/train.py                                  # builds sample-data/ first
    python scripts/train.py train.lmdb --val val.lmdb --epochs 10 --batch-size 128
    python scripts/train.py train.lmdb --resume              # continue mid-epoch
    python scripts/train.py mongodb://127.0.0.1:27017/images --collection train

Prints where the checkpoint goes (beside an LMDB store, ``train.lmdb.checkpoint.pt``; for a
MongoDB collection, ``$XDG_STATE_HOME/fastdata/checkpoints/HOST/DATABASE/COLLECTION.checkpoint.pt``,
``~/.local/state`` when XDG_STATE_HOME is unset; ``--checkpoint`` chooses), a progress bar, and
per epoch the loss, the accuracy, images/s and the share of time the training loop spent
waiting for data. The checkpoint holds the model, the optimiser, the loader's position and the
store's id, so a resumed run sees exactly the samples it had not seen yet, whatever the batch
size or worker count it resumes with (and on any number of ranks: the position is the job's).
A store that grew since (``--append``) finishes the interrupted epoch over the samples it began
with; the new ones join from the next epoch. A checkpoint of another store is refused;
``--restart-epoch`` starts the epoch it stopped in again from its beginning instead, the model
and the optimiser as saved.

Ctrl-C finishes the step under way, saves the checkpoint and prints the command that resumes
from it (exit 130); a second Ctrl-C stops at once, keeping the checkpoint saved last. The model
is a classifier: a store without classes (an image-text set) is refused.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import signal
import sys
import time
from pathlib import Path
from typing import Any, NoReturn
from urllib.parse import quote

import click
import torch
from torch import nn

from fastdata import FastdataError, LMDBImageDataset, MongoImageDataset, convert, create_loader
from fastdata.images.synthetic import make_image_folder


def compact_cnn(classes: int, width: int = 32) -> nn.Module:
    def block(cin: int, cout: int) -> nn.Sequential:
        return nn.Sequential(
            nn.Conv2d(cin, cout, 3, stride=2, padding=1, bias=False),
            nn.BatchNorm2d(cout),
            nn.ReLU(inplace=True),
        )

    return nn.Sequential(
        block(3, width),
        block(width, width * 2),
        block(width * 2, width * 4),
        block(width * 4, width * 8),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(width * 8, classes),
    )


def usage(message: str) -> NoReturn:
    """A mistake in how the script was called: one line, exit 2 (as ``fastdata`` does)."""
    print(f"Error: {message}", file=sys.stderr)
    sys.exit(2)


def workers_option(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give 'auto' or a number >= 0")
    return value


def sample_store(workdir: Path) -> Path:
    store = workdir / "images.lmdb"
    if not (store / "data.mdb").exists():
        make_image_folder(workdir / "images", classes=10, per_class=60)
        convert(workdir / "images", store, overwrite=True)
    return store


def is_mongo(store: str) -> bool:
    return store.startswith(("mongodb://", "mongodb+srv://"))


def open_dataset(store: str, collection: str | None, what: str = "") -> Any:
    dataset: Any
    if is_mongo(store):
        if not collection:
            usage(f"{store}: a MongoDB store needs --collection NAME")
        dataset = MongoImageDataset(store, collection)
    else:
        dataset = LMDBImageDataset(store)
    if not dataset.classes:
        usage(
            f"{what}{dataset.reader.location}: the store has no classes (every target is -1: an "
            "image-text set?); this script trains a classifier: give it a store converted from "
            "class folders or from a manifest with labels"
        )
    return dataset


def checkpoint_home() -> Path:
    """Where the checkpoints of MongoDB stores go unless --checkpoint says: the XDG state
    folder (``$XDG_STATE_HOME``, else ``~/.local/state``), under ``fastdata/checkpoints``."""
    state = os.environ.get("XDG_STATE_HOME") or os.path.join(
        os.path.expanduser("~"), ".local", "state"
    )
    return Path(state, "fastdata", "checkpoints")


def default_checkpoint(store: str, collection: str | None) -> Path:
    """Beside an LMDB store; for a MongoDB collection, under :func:`checkpoint_home`, in a
    folder per server and database (never the current folder: a run started elsewhere finds
    it too). Each part is quoted, so that no name reaches outside its folder."""
    if is_mongo(store):
        rest = store.split("://", 1)[1].split("?")[0]
        hosts, _, database = rest.partition("/")
        hosts = hosts.rpartition("@")[2]  # (never the credentials in a file name)

        def part(name: str) -> str:
            quoted = quote(name, safe="")
            return "%2E" + quoted[1:] if quoted.startswith(".") else quoted

        return (
            checkpoint_home()
            / part(hosts)
            / part(database or "db")
            / (part(collection or "") + ".checkpoint.pt")
        )
    return Path(store.rstrip("/") + ".checkpoint.pt")


def resume_command(args: argparse.Namespace, store: str, checkpoint: Path) -> str:
    """The command that goes on from ``checkpoint`` with this run's settings, runnable as
    printed from any folder (paths absolute, words quoted for the shell)."""

    def where(path: str) -> str:
        return path if is_mongo(path) else os.path.abspath(path)

    words = [sys.executable, os.path.abspath(sys.argv[0]), where(store)]
    if args.collection:
        words += ["--collection", args.collection]
    if args.val:
        words += ["--val", where(args.val)]
    words += ["--epochs", str(args.epochs), "--batch-size", str(args.batch_size)]
    words += ["--image-size", str(args.image_size), "--workers", str(args.workers)]
    words += ["--lr", repr(args.lr), "--seed", str(args.seed)]
    if args.device:
        words += ["--device", args.device]
    words += ["--checkpoint", os.path.abspath(checkpoint), "--save-every", str(args.save_every)]
    return shlex.join([*words, "--resume"])


class Interrupt:
    """Ctrl-C while training: the first asks the loop to stop after the step under way (it
    then saves the checkpoint); a second stops at once (KeyboardInterrupt). DataLoader
    workers forked while this handler is set inherit it, so a Ctrl-C at the terminal, which
    reaches them too, does not end them under the loop."""

    def __init__(self) -> None:
        self.asked = False
        signal.signal(signal.SIGINT, self._pressed)

    def _pressed(self, signum: int, frame: Any) -> None:
        if self.asked:
            raise KeyboardInterrupt
        self.asked = True


def resume_state(path: Path, dataset: Any, device: Any) -> dict[str, Any]:
    """The checkpoint at ``path``, refused (one line, then exit 2) if it cannot apply."""
    if not path.exists():
        usage(f"{path}: no checkpoint to resume from; run without --resume first")
    try:
        state = torch.load(path, map_location=device, weights_only=True)
        saved_id = state.get("store_id")
        int(state["loader"]["samples"])
        if "model" not in state or "optimizer" not in state:
            raise KeyError("model" if "model" not in state else "optimizer")
    except Exception as exc:  # a folder, an empty or damaged file, another program's .pt
        usage(
            f"{path}: not a checkpoint this script can resume from ({type(exc).__name__}: "
            f"{exc}); give --checkpoint the file it saved, or start fresh without --resume"
        )
    meta = dataset.reader.meta
    ours = {meta.id, *meta.appended_from}
    if saved_id is not None and saved_id not in ours:
        usage(
            f"{path} was saved while training on another store (id {saved_id}, this one "
            f"is {meta.id}): start fresh without --resume, or give --checkpoint another path"
        )
    # checkpoints saved before the count was kept: the rows of the model's last weight
    weights = [t for t in state["model"].values() if t.dim() == 2]
    classes = state.get("classes", weights[-1].shape[0] if weights else len(dataset.classes))
    if classes != len(dataset.classes):
        usage(
            f"{path} was saved for {classes} classes and the store now has "
            f"{len(dataset.classes)} (an append added classes): the model's output cannot "
            "take them; start fresh without --resume"
        )
    return state


def snapshot(model: nn.Module, optimizer: Any, loader: Any, store_id: str) -> dict[str, Any]:
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "loader": loader.state_dict(),
        "store_id": store_id,
        "classes": len(loader.dataset.classes),
    }


def save(path: Path, state: dict[str, Any]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)  # a crash never leaves half a checkpoint


def evaluate(model: nn.Module, loader: Any) -> float:
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for images, labels in loader:
            correct += (model(images).argmax(1) == labels).sum().item()
            total += len(labels)
    model.train()
    return correct / max(1, total)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "store", nargs="?", help="LMDB store or mongodb:// URI (default: a sample LMDB store)"
    )
    ap.add_argument("--collection", help="the collection, for a MongoDB store")
    ap.add_argument("--val", help="a store (of the same kind) to evaluate on after each epoch")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--image-size", type=int, default=96)
    ap.add_argument("--workers", default="auto", type=workers_option, help="'auto' or a number")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", help="cuda, cpu, ... (default: the accelerator if any)")
    ap.add_argument(
        "--checkpoint",
        type=Path,
        help="default: STORE.checkpoint.pt beside an LMDB store; for MongoDB, "
        "HOST/DATABASE/COLLECTION.checkpoint.pt under $XDG_STATE_HOME/fastdata/checkpoints "
        "(~/.local/state/fastdata/checkpoints when XDG_STATE_HOME is unset)",
    )
    ap.add_argument("--save-every", type=int, default=20, help="steps between checkpoints")
    ap.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    ap.add_argument(
        "--restart-epoch",
        action="store_true",
        help="with --resume: start the epoch it stopped in again from its beginning",
    )
    ap.add_argument("--workdir", type=Path, default=Path("sample-data"))
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        train(args)
    except KeyboardInterrupt:  # before training began, or a second Ctrl-C
        print("\ninterrupted before training began (nothing saved)", file=sys.stderr)
        sys.exit(130)


def train(args: argparse.Namespace) -> None:
    torch.manual_seed(args.seed)
    store = args.store or str(sample_store(args.workdir))
    checkpoint = args.checkpoint or default_checkpoint(store, args.collection)
    workers = args.workers
    if args.resume and not checkpoint.exists():  # before any store is opened or measured
        usage(f"{checkpoint}: no checkpoint to resume from; run without --resume first")
    if args.restart_epoch and not args.resume:
        usage(
            "--restart-epoch goes with --resume: it starts again the epoch a checkpoint stopped in"
        )
    if checkpoint.exists() and not args.resume:  # (an earlier run's: never overwritten unasked)
        usage(
            f"{checkpoint} holds the checkpoint of an earlier run: continue it with --resume, or "
            f"start afresh with --checkpoint another path (or after `rm {shlex.quote(str(checkpoint))}`)"
        )
    try:
        dataset = open_dataset(store, args.collection)
        loader = create_loader(
            dataset,
            args.batch_size,
            image_size=args.image_size,
            num_workers=workers,
            device=args.device,
            seed=args.seed,
            channels_last=True,
        )
    except FastdataError as exc:  # a store that cannot train: say why, stop (as fastdata does)
        print(f"Error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
    except ValueError as exc:  # an option that does not fit the store
        usage(str(exc))
    device = loader.device
    model = compact_cnn(len(dataset.classes)).to(device, memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-5)
    val_loader = None
    if args.val:
        try:
            val_loader = create_loader(
                open_dataset(args.val, args.collection, "--val "),
                args.batch_size,
                train=False,
                image_size=args.image_size,
                num_workers=loader.num_workers,
                device=device,
            )
        except FastdataError as exc:
            print(f"Error: --val {exc}", file=sys.stderr)
            sys.exit(exc.exit_code)
        except ValueError as exc:
            usage(f"--val {exc}")

    interrupt = Interrupt()  # (before the line below: a caller may wait for it to press Ctrl-C)
    print(f"checkpoint: {checkpoint}", flush=True)
    if args.resume:
        state = resume_state(checkpoint, dataset, device)
        try:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            loader.load_state_dict(state["loader"], restart_epoch=args.restart_epoch)
        except FastdataError as exc:  # a position that cannot continue here: the way out
            usage(f"cannot resume from {checkpoint}: {exc.without_hint(cli=True)}")
        except (ValueError, RuntimeError, KeyError) as exc:  # another model or loader setup
            usage(f"cannot resume from {checkpoint}: {exc}")
        if loader.epoch >= args.epochs:
            print(
                f"{checkpoint}: its run is done ({args.epochs} epochs, the checkpoint is at epoch "
                f"{loader.epoch}); raise --epochs to train on"
            )
            return
        print(f"resumed from {checkpoint}: {loader.resume_note}")
    checkpoint.parent.mkdir(parents=True, exist_ok=True)
    store_id = dataset.reader.meta.id
    loss_fn = nn.CrossEntropyLoss()
    saved = args.resume  # whether the checkpoint holds this run (or the one it resumed)

    def stop() -> NoReturn:
        """Ctrl-C: the checkpoint saved at the last step done, and the command that resumes."""
        save(checkpoint, snapshot(model, optimizer, loader, store_id))
        where, command = loader.position(), resume_command(args, store, checkpoint)
        print(
            f"\ninterrupted at epoch {where.epoch}, sample {where.position:,} of "
            f"{where.samples:,}: checkpoint saved "
            f"to {os.path.abspath(checkpoint)}; resume with:\n  {command}",
            file=sys.stderr,
            flush=True,
        )
        sys.exit(130)

    try:
        while loader.epoch < args.epochs:
            if interrupt.asked:
                stop()
            epoch = loader.epoch
            seen = correct = 0
            loss_sum = 0.0
            waited = 0.0
            started = time.perf_counter()
            batches = iter(loader)
            with click.progressbar(length=len(loader), label=f"epoch {epoch}", file=None) as bar:
                step = 0
                while True:
                    t = time.perf_counter()
                    try:
                        images, labels = next(batches)
                    except StopIteration:
                        break
                    except Exception:  # workers that a Ctrl-C at the terminal ended (spawned)
                        if interrupt.asked:
                            stop()
                        raise
                    waited += time.perf_counter() - t
                    logits = model(images)
                    loss = loss_fn(logits, labels)
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    optimizer.step()
                    loss_sum += loss.item() * len(labels)
                    correct += (logits.argmax(1) == labels).sum().item()
                    seen += len(labels)
                    step += 1
                    bar.update(1)
                    if interrupt.asked:
                        stop()
                    if step % args.save_every == 0:
                        save(checkpoint, snapshot(model, optimizer, loader, store_id))
                        saved = True
            elapsed = time.perf_counter() - started
            if not seen:  # (resumed after the epoch's last step: nothing of it was left)
                print(f"epoch {epoch}: every sample was delivered before the checkpoint")
                save(checkpoint, snapshot(model, optimizer, loader, store_id))
                continue
            line = (
                f"epoch {epoch}: loss {loss_sum / max(1, seen):.3f}  "
                f"train acc {correct / max(1, seen):.3f}  {seen / elapsed:.0f} images/s  "
                f"waiting for data {waited / elapsed:.0%}"
            )
            if val_loader is not None:
                line += f"  val acc {evaluate(model, val_loader):.3f}"
            print(line, flush=True)
            save(checkpoint, snapshot(model, optimizer, loader, store_id))
            saved = True
    except KeyboardInterrupt:  # a second Ctrl-C: what was saved last is kept
        kept = (
            "the checkpoint saved last is kept; resume with:\n  "
            + resume_command(args, store, checkpoint)
            if saved
            else "no checkpoint was saved yet"
        )
        print(f"\ninterrupted: {kept}", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
