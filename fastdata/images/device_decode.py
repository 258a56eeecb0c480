"""Batches of encoded images decoded together, cropped, resized and flipped as tensors on the
device: for a node whose CPUs cannot decode as fast as its GPU trains.

A pipeline's :class:`~fastdata.images.pipelines.CropPlan` (drawn from each sample's seed, in the
loader's workers, from the image header alone) says what to keep; :class:`DeviceDecoder` decodes
a batch of JPEGs with one call and follows the plans:

- ``nvimgcodec`` (NVIDIA nvImageCodec, the ``gpu`` extra) decodes only the
  crop window of each JPEG (a region per image), on the GPU, or with its CPU backend where no
  CUDA device is given (how the tests run it; slower there than the CPU pipeline in workers);
- ``torchvision`` (``torchvision.io.decode_jpeg(device="cuda")``) decodes whole JPEGs on the GPU,
  then the window is cut out;
- ``cpu``: the CPU pipeline (:func:`~fastdata.images.pipelines.render`), image by image.

A record the backend cannot take (not a JPEG, or a JPEG it fails on) goes through the CPU
pipeline with the same plan; a batch that needed that logs one line (a warning the first time,
then at debug level), never one per image. The crop is resized with an antialiased bilinear
filter in float32 and rounded back to uint8, so pixels match the CPU path's to the decoders'
and the filters' rounding. Nothing here is required: without nvImageCodec and torchvision the
decoder is the CPU one, said once. Which backends this machine has is
:mod:`~fastdata.images.device_backends`'s; the plans that a loader's workers hand over come from
:class:`~fastdata.images.pipelines.Planned`.
"""

from __future__ import annotations

import logging
import numbers
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import CorruptImageError
from . import pipelines
from .codec import is_jpeg
from .device_backends import BACKENDS, available_backends, load_nvimgcodec, nvimgcodec_install_hint
from .device_finish import chunks, finish_batch, finish_one
from .pipelines import CropPlan, render

if TYPE_CHECKING:
    import torch

__all__ = [
    "GROUP_PIXELS",
    "MAX_THREADS",
    "BatchImageError",
    "DeviceDecoder",
    "checked_options",
]

log = logging.getLogger(__name__)

GROUP_PIXELS = 32 << 20
"""Window pixels decoded by one call at most (about 100 MB of RGB): a batch of large photos, or
of images that declare just under the pixel limit, is decoded a group at a time."""
FINISH_PIXELS = 16 << 20
"""Padded window pixels resized by one batched call at most (its float copy: 192 MB)."""
ALONE_PIXELS = 4 << 20
"""A window larger than this is resized on its own, a strip at a time, not padded in a batch."""


class BatchImageError(CorruptImageError):
    """An image of a batch that no decoder could read: ``position`` in the batch, and the
    decoder's error (the loader names the record from the position)."""

    def __init__(self, position: int, error: CorruptImageError) -> None:
        super().__init__(f"image {position} of the batch", error.reason)
        self.position = position


MAX_THREADS = 1024
"""The most host threads ``threads`` may ask nvImageCodec for (it starts as many as asked)."""


def _share(hardware: Any) -> float | None:
    """``hardware`` checked: a number from 0 to 1 (not a bool, not a string), or None."""
    if hardware is None:
        return None
    if isinstance(hardware, bool) or not isinstance(hardware, numbers.Real):
        raise ValueError(
            f"hardware={hardware!r}: give a share from 0 to 1 as a number (1.0: all to the "
            "hardware decoders), or None"
        )
    share = float(hardware)
    if not 0 <= share <= 1:
        raise ValueError(f"hardware={hardware!r}: give a share from 0 to 1, or None")
    return share


def _thread_count(threads: Any) -> int:
    """``threads`` checked: an integer from 0 (one per core) to :data:`MAX_THREADS`."""
    if isinstance(threads, bool) or not isinstance(threads, numbers.Integral):
        raise ValueError(f"threads={threads!r}: give an integer, 0 (one per core) or more")
    count = int(threads)
    if not 0 <= count <= MAX_THREADS:
        raise ValueError(f"threads={threads!r}: give 0 (one per core) or more, up to {MAX_THREADS}")
    return count


def _flag(name: str, value: Any) -> bool:
    """An on/off option checked: True or False (``"false"`` is not False)."""
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name}={value!r}: give True or False")
    return bool(value)


CHECKS = {"hardware": _share, "threads": _thread_count}


def checked_options(options: dict[str, Any]) -> dict[str, Any]:
    """:class:`DeviceDecoder`'s ``hardware``, ``regions``, ``threads`` and ``batched`` among
    ``options``, checked (as its constructor checks them) and made plain Python values.

    Raises:
        ValueError: a value of the wrong type or out of range, named with what to give.
    """
    return {
        name: CHECKS[name](value) if name in CHECKS else _flag(name, value)
        for name, value in options.items()
    }


class DeviceDecoder:
    """Decode a batch of encoded images into one ``N x 3 x H x W`` uint8 tensor on ``device``,
    following each image's :class:`~fastdata.images.pipelines.CropPlan`.

    Example::

        decoder = DeviceDecoder("cuda")
        pipeline = TrainPipeline(224)
        plans = [pipeline.plan(data, seed) for data, seed in zip(jpegs, seeds)]
        images = decoder(jpegs, plans)            # uint8, N x 3 x 224 x 224, on the GPU

    Args:
        device: where the batch is made.
        backend: ``"auto"`` (nvImageCodec, then torchvision on CUDA, then the CPU pipeline),
            or one of :data:`BACKENDS` by name.
        fast: for records that take the CPU pipeline: libjpeg-turbo's fast IDCT (as the
            pipeline's ``fast_decode``).
        hardware: nvImageCodec on CUDA: the share of each batch given to the GPU's hardware
            JPEG decoders (the NVJPG engines of an A100 or H100, which leave the GPU's cores
            to training; what they cannot take goes to the CUDA decoder): a number from 0 to
            1, or None for nvImageCodec's own choice.
        regions: nvImageCodec: decode only each image's crop window (True), or the whole
            image and cut the window out on the device (False: what a decoder that takes no
            regions needs).
        threads: nvImageCodec: host threads its decoders may use (0: one per CPU core). The
            CUDA decoder's Huffman stage of small images runs on them.
        batched: on CUDA, resize, flip and jitter a batch's windows together, two matrix
            products per chunk of windows (:func:`fastdata.images.device_finish.finish_batch`),
            instead of about ten device operations per image: fewer kernel launches from the
            decoding thread, at the price of padding the windows to one size.

    Raises:
        ValueError: an unknown backend, or one that cannot run here (the message says what
            to install).
    """

    def __init__(
        self,
        device: torch.device | str = "cpu",
        *,
        backend: str = "auto",
        fast: bool = False,
        hardware: float | None = None,
        regions: bool = True,
        threads: int = 0,
        batched: bool = False,
    ) -> None:
        import torch

        self.hardware, self.threads = _share(hardware), _thread_count(threads)
        self.regions, self.batched = _flag("regions", regions), _flag("batched", batched)

        if backend not in BACKENDS:
            raise ValueError(f"decode backend {backend!r}: choose one of {', '.join(BACKENDS)}")
        self.device = torch.device(device)
        self.fast = fast
        found = available_backends(self.device)
        if backend == "auto":
            backend = found[0]
            if backend == "cpu":
                log.warning(
                    "device decode: neither nvImageCodec nor torchvision's GPU decoder can be "
                    "used here; images are decoded by the CPU pipeline (to add nvImageCodec: "
                    "%s)",
                    nvimgcodec_install_hint(),
                )
        elif backend not in found:
            needs = {
                "nvimgcodec": f"nvImageCodec: {nvimgcodec_install_hint()}",
                "torchvision": "a CUDA device and a torchvision that imports with this torch",
            }
            raise ValueError(
                f"decode backend {backend!r} cannot run here: it needs {needs[backend]}"
            )
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {self.device}: this torch has no CUDA device to decode on")
        self.backend = backend
        self._codec: Any = None  # the nvImageCodec decoder, made on first use in this process
        self._lock = threading.Lock()  # one batch at a time: the native decoder is not shared
        self._warned = False

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_codec"] = None  # a native handle: made again where it is used
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        extra = "" if self.hardware is None else f", hardware={self.hardware}"
        extra += "" if self.regions else ", regions=False"
        extra += ", batched=True" if self.batched else ""
        return f"DeviceDecoder(device={str(self.device)!r}, backend={self.backend!r}{extra})"

    def __call__(self, datas: Sequence[bytes], plans: Sequence[CropPlan]) -> torch.Tensor:
        """Decode ``datas`` as ``plans`` say; all plans must have one output size.

        Raises:
            ValueError: no images, plans of another number or of mixed output sizes.
            CorruptImageError: an image no decoder can read (from the CPU pipeline, which
                names it).
        """
        import torch

        if not datas or len(datas) != len(plans):
            raise ValueError(f"{len(datas)} images and {len(plans)} plans: give one plan each")
        out = plans[0].out
        if any(plan.out != out for plan in plans):
            raise ValueError("the plans of one batch must have one output size")
        # On the CPU, each image's few small tensor ops would wake torch's whole thread pool,
        # whose spinning threads then take the cores the decoder's threads need (measured:
        # 3x the CPU time per image, and erratic); one thread does them faster.
        # (torch's thread count is the process's: a thread that first uses torch meanwhile
        # starts with one thread; this path is for machines without CUDA, a check more than a
        # way to train)
        with self._lock:
            threads = torch.get_num_threads()
            if self.device.type == "cpu" and threads > 1:
                torch.set_num_threads(1)
            try:
                batch, on_cpu = self._decode_all(datas, plans, out)
            finally:
                if torch.get_num_threads() != threads:
                    torch.set_num_threads(threads)
        if on_cpu and self.backend != "cpu":
            level = logging.DEBUG if self._warned else logging.WARNING
            self._warned = True
            log.log(
                level,
                "device decode: %d of %d images in this batch went through the CPU pipeline "
                "(not JPEGs, or JPEGs %s could not decode)",
                on_cpu,
                len(datas),
                self.backend,
            )
        return batch

    def _decode_all(
        self, datas: Sequence[bytes], plans: Sequence[CropPlan], out: tuple[int, int]
    ) -> tuple[torch.Tensor, int]:
        """The batch, and how many of its images the CPU pipeline decoded."""
        import torch

        batch = torch.empty((len(datas), 3, *out), dtype=torch.uint8, device=self.device)
        on_cpu = 0
        for group in self._groups(datas, plans):
            regions: list[Any] = [None] * len(group)
            jpegs = (
                []
                if self.backend == "cpu"
                else [k for k, i in enumerate(group) if is_jpeg(datas[i])]
            )
            if jpegs:
                decoded = self._decode(
                    [datas[group[k]] for k in jpegs], [plans[group[k]] for k in jpegs]
                )
                for k, region in zip(jpegs, decoded, strict=True):
                    regions[k] = region
            together: list[tuple[int, Any]] = []  # (position, window): finished as one
            for k, i in enumerate(group):
                region, regions[k] = regions[k], None
                if region is None:
                    on_cpu += 1
                    try:
                        hwc = torch.from_numpy(render(datas[i], plans[i], self.fast))
                    except CorruptImageError as exc:  # which image of the batch, for the caller
                        raise BatchImageError(i, exc) from exc
                    batch[i].copy_(hwc.permute(2, 0, 1), non_blocking=True)
                elif (
                    not self.batched
                    or self.device.type != "cuda"
                    or region.shape[1] * region.shape[2] > ALONE_PIXELS
                ):
                    # one at a time: where each operation costs its arithmetic, not a kernel
                    # launch (the CPU), or a window too large to pad (reduced in strips)
                    batch[i] = finish_one(region, plans[i])
                else:
                    together.append((i, region))
            for chunk in chunks(together, FINISH_PIXELS):
                self._finish_together(batch, chunk, plans, out)
        return batch, on_cpu

    @staticmethod
    def _finish_together(
        batch: torch.Tensor,
        chunk: list[tuple[int, Any]],
        plans: Sequence[CropPlan],
        out: tuple[int, int],
    ) -> None:
        """Windows resized, flipped and jittered as one batch, into their places in ``batch``."""
        import torch

        windows = [region for _, region in chunk]
        chosen = [plans[i] for i, _ in chunk]
        boxes = [(0, 0, int(w.shape[1]), int(w.shape[2])) for w in windows]
        shrink = [pipelines.shrink_for(b[2], b[3], *out) for b in boxes]
        done = finish_batch(
            windows, boxes, shrink, out, [p.flip for p in chosen], [p.jitter for p in chosen]
        )
        places = [i for i, _ in chunk]
        if places == list(range(places[0], places[0] + len(places))):
            batch[places[0] : places[0] + len(places)] = done
        else:
            batch[torch.tensor(places, device=batch.device)] = done

    def _groups(self, datas: Sequence[bytes], plans: Sequence[CropPlan]) -> list[list[int]]:
        """The batch's images in decode calls of at most :data:`GROUP_PIXELS` window pixels
        (one image alone however large): what is decoded at once is bounded by that, not by
        what the images declare. The CPU backend takes them one by one."""
        if self.backend == "cpu":
            return [[i] for i in range(len(datas))]
        groups: list[list[int]] = [[]]
        held = 0
        for i, plan in enumerate(plans):
            y0, x0, y1, x1 = plan.pixels(*plan.full)
            pixels = (y1 - y0) * (x1 - x0)
            if groups[-1] and held + pixels > GROUP_PIXELS:
                groups.append([])
                held = 0
            groups[-1].append(i)
            held += pixels
        return groups

    def batch(self, encoded: Any) -> tuple[torch.Tensor, Any]:
        """``(data, plans, labels, ...)`` (an :class:`~fastdata.loaders.collate.EncodedBatch`)
        -> ``(images, labels)``: what ``PrefetchLoader(decode=...)`` calls per batch."""
        data, plans, labels = encoded[:3]
        return self(data, plans), labels

    # -- the backends: each returns a CHW uint8 tensor of the plan's window per image, on the
    #    device, or None for an image it could not decode

    def _decode(self, datas: Sequence[bytes], plans: Sequence[CropPlan]) -> list[Any]:
        if self.backend == "nvimgcodec":
            return self._decode_nvimgcodec(datas, plans)
        return self._decode_torchvision(datas, plans)

    def _decode_nvimgcodec(self, datas: Sequence[bytes], plans: Sequence[CropPlan]) -> list[Any]:
        import numpy as np
        import torch

        nv = load_nvimgcodec()
        cuda = self.device.type == "cuda"
        if self._codec is None:
            self._codec = self._make_codec(nv, cuda)
        streams: list[Any] = []
        for data, plan in zip(datas, plans, strict=True):
            try:  # (its parser reads the header lazily: the size is where it refuses one)
                stream = nv.CodeStream(data)
                size = (stream.height, stream.width)
            except Exception:  # a header its parser refuses: the CPU pipeline decides
                streams.append(None)
                continue
            if size != plan.full:
                streams.append(None)  # the header says otherwise than the plan: the CPU decides
                continue
            if self.regions:
                y0, x0, y1, x1 = plan.pixels(*plan.full)
                stream = stream.get_sub_code_stream(region=nv.Region(start=(y0, x0), end=(y1, x1)))
            streams.append(stream)
        valid = [s for s in streams if s is not None]
        params = nv.DecodeParams(
            apply_exif_orientation=False,  # as the CPU decoders: the stored pixels, unrotated
            color_spec=nv.ColorSpec.SRGB,
            sample_format=nv.SampleFormat.I_RGB,
        )
        kwargs: dict[str, Any] = {"params": params}
        if cuda:
            kwargs["cuda_stream"] = torch.cuda.current_stream(self.device).cuda_stream
        try:
            decoded = self._codec.decode(valid, **kwargs) if valid else []
        except Exception:  # the whole call failed: each image goes through the CPU pipeline
            decoded = [None] * len(valid)
        if self.regions and len(valid) > 1 and all(image is None for image in decoded):
            # every window of the call refused, though each header parsed: decoders that take
            # no regions (nvJPEG's hardware backend among them); whole images from now on
            log.warning(
                "device decode: nvImageCodec decoded none of %d crop windows; decoding whole "
                "images and cutting the windows out on the device from now on",
                len(valid),
            )
            self.regions = False
            return self._decode_nvimgcodec(datas, plans)
        images = iter(decoded)
        out: list[Any] = []
        for stream, plan in zip(streams, plans, strict=True):
            image = next(images) if stream is not None else None
            if image is None:
                out.append(None)
                continue
            if cuda:
                chw = torch.from_dlpack(image).permute(2, 0, 1)
            else:
                hwc = np.asarray(image.cpu())
                chw = torch.from_numpy(hwc).permute(2, 0, 1).to(self.device)
            if not self.regions:
                if tuple(chw.shape[1:]) != plan.full:
                    out.append(None)
                    continue
                y0, x0, y1, x1 = plan.pixels(*plan.full)
                chw = chw[:, y0:y1, x0:x1]
            out.append(chw)
        return out

    def _make_codec(self, nv: Any, cuda: bool) -> Any:
        """nvImageCodec's decoder for this device: on CUDA the hardware decoders first (at
        the share asked for) where the GPU has them, then the CUDA decoder."""
        if not cuda:
            cpu = [nv.Backend(nv.BackendKind.CPU_ONLY)]
            return nv.Decoder(
                device_id=nv.NVIMGCODEC_DEVICE_CPU_ONLY,
                backends=cpu,
                max_num_cpu_threads=self.threads,
            )
        device = self.device.index or 0
        if self.hardware is not None:
            backends = [nv.Backend(nv.BackendKind.GPU_ONLY)]
            if self.hardware > 0:
                hw = nv.Backend(nv.BackendKind.HW_GPU_ONLY, load_hint=self.hardware)
                backends.insert(0, hw)
            try:
                return nv.Decoder(
                    device_id=device, max_num_cpu_threads=self.threads, backends=backends
                )
            except RuntimeError as exc:  # (seen: the CUDA decoder alone, "Code: 7")
                log.warning(
                    "device decode: nvImageCodec refused the backends for hardware=%s (%s); "
                    "it chooses its own",
                    self.hardware,
                    exc,
                )
        return nv.Decoder(device_id=device, max_num_cpu_threads=self.threads)

    def _decode_torchvision(self, datas: Sequence[bytes], plans: Sequence[CropPlan]) -> list[Any]:
        import torch
        from torchvision.io import ImageReadMode, decode_jpeg

        encoded = [torch.frombuffer(bytearray(data), dtype=torch.uint8) for data in datas]
        try:
            images = decode_jpeg(encoded, mode=ImageReadMode.RGB, device=self.device)
        except RuntimeError:  # one bad JPEG fails the batch: decode one by one to find it
            images = []
            for tensor in encoded:
                try:
                    images.append(decode_jpeg(tensor, mode=ImageReadMode.RGB, device=self.device))
                except RuntimeError:
                    images.append(None)
        out: list[Any] = []
        for image, plan in zip(images, plans, strict=True):
            if image is None or tuple(image.shape[1:]) != plan.full:
                out.append(None)
                continue
            y0, x0, y1, x1 = plan.pixels(*plan.full)
            out.append(image[:, y0:y1, x0:x1])
        return out
