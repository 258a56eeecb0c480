#!/usr/bin/env python
"""Train a compact CNN on an LMDB store through create_loader: a complete, resumable example.

    python scripts/train.py                                  # builds sample-data/ first
    python scripts/train.py train.lmdb --val val.lmdb --epochs 10 --batch-size 128
    python scripts/train.py train.lmdb --checkpoint run.pt --resume   # continue mid-epoch

Prints a progress bar, and per epoch the loss, the accuracy, images/s and the share of time the
training loop spent waiting for data. The checkpoint holds the model, the optimiser and the
loader's position, so a resumed run sees exactly the batches it had not seen yet.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import click
import torch
from torch import nn

from fastdata import FastdataError, LMDBImageDataset, convert, create_loader
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


def sample_store(workdir: Path) -> Path:
    store = workdir / "images.lmdb"
    if not (store / "data.mdb").exists():
        make_image_folder(workdir / "images", classes=10, per_class=60)
        convert(workdir / "images", store, overwrite=True)
    return store


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
    ap.add_argument("store", nargs="?", type=Path, help="LMDB store (default: a sample one)")
    ap.add_argument("--val", type=Path, help="LMDB store to evaluate on after each epoch")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--image-size", type=int, default=96)
    ap.add_argument("--workers", default="auto", help="'auto' or a number")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", help="cuda, cpu, ... (default: the accelerator if any)")
    ap.add_argument("--checkpoint", type=Path, default=Path("sample-data/train-checkpoint.pt"))
    ap.add_argument("--save-every", type=int, default=20, help="steps between checkpoints")
    ap.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    ap.add_argument("--workdir", type=Path, default=Path("sample-data"))
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    torch.manual_seed(args.seed)
    store = args.store or sample_store(args.workdir)
    workers = args.workers if args.workers == "auto" else int(args.workers)
    try:
        dataset = LMDBImageDataset(store)
        loader = create_loader(
            dataset,
            args.batch_size,
            image_size=args.image_size,
            num_workers=workers,
            device=args.device,
            seed=args.seed,
            channels_last=True,
        )
    except (FastdataError, ValueError) as exc:  # a store that cannot train: say why, stop
        sys.exit(f"Error: {exc}")
    device = loader.device
    model = compact_cnn(len(dataset.classes)).to(device, memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-5)
    val_loader = None
    if args.val:
        val_loader = create_loader(
            LMDBImageDataset(args.val),
            args.batch_size,
            train=False,
            image_size=args.image_size,
            num_workers=loader.num_workers,
            device=device,
        )

    if args.resume:
        state = torch.load(args.checkpoint, map_location=device, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        loader.load_state_dict(state["loader"])
        done = state["loader"]["batches"]
        print(f"resumed from {args.checkpoint}: epoch {loader.epoch}, batch {done}")
    args.checkpoint.parent.mkdir(parents=True, exist_ok=True)
    loss_fn = nn.CrossEntropyLoss()

    while loader.epoch < args.epochs:
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
                if step % args.save_every == 0:
                    save(
                        args.checkpoint,
                        {
                            "model": model.state_dict(),
                            "optimizer": optimizer.state_dict(),
                            "loader": loader.state_dict(),
                        },
                    )
        elapsed = time.perf_counter() - started
        line = (
            f"epoch {epoch}: loss {loss_sum / max(1, seen):.3f}  "
            f"train acc {correct / max(1, seen):.3f}  {seen / elapsed:.0f} images/s  "
            f"waiting for data {waited / elapsed:.0%}"
        )
        if val_loader is not None:
            line += f"  val acc {evaluate(model, val_loader):.3f}"
        print(line)
        save(
            args.checkpoint,
            {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "loader": loader.state_dict(),
            },
        )


if __name__ == "__main__":
    main()
