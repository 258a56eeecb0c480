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
decoder is the CPU one, said once.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..errors import CorruptImageError
from . import pipelines
from .codec import is_jpeg
from .pipelines import CropPlan, Pipeline, render

if TYPE_CHECKING:
    import torch

__all__ = [
    "BACKENDS",
    "GROUP_PIXELS",
    "BatchImageError",
    "DeviceDecoder",
    "Planned",
    "available_backends",
]

log = logging.getLogger(__name__)

BACKENDS: tuple[str, ...] = ("auto", "nvimgcodec", "torchvision", "cpu")
"""The names :class:`DeviceDecoder` takes for ``backend``."""

GROUP_PIXELS = 32 << 20
"""Window pixels decoded by one call at most (about 100 MB of RGB): a batch of large photos, or
of images that declare just under the pixel limit, is decoded a group at a time."""
STRIP_ROWS = 32
"""Output rows of a window reduced at a time before its resize (see :func:`_reduce`)."""


class BatchImageError(CorruptImageError):
    """An image of a batch that no decoder could read: ``position`` in the batch, and the
    decoder's error (the loader names the record from the position)."""

    def __init__(self, position: int, error: CorruptImageError) -> None:
        super().__init__(f"image {position} of the batch", error.reason)
        self.position = position


_import_lock = threading.Lock()
_nvimgcodec: list[Any] = []  # [module or None], filled once per process


def _load_nvimgcodec() -> Any:
    """nvImageCodec's module, or None. Its import prints to the C-level stderr about every
    CUDA library it cannot find (all of them on a machine without CUDA, where its CPU backend
    still works): that output is held back, and the module's own errors come as exceptions."""
    with _import_lock:
        if not _nvimgcodec:
            # its decoders' messages (one or two per damaged image) go to the C-level stderr,
            # past logging's reach: off unless the user asks (we log one line per batch)
            os.environ.setdefault("PYNVIMGCODEC_VERBOSITY", "0")
            saved = os.dup(2)
            try:
                with open(os.devnull, "wb") as devnull:
                    os.dup2(devnull.fileno(), 2)
                    try:
                        from nvidia import nvimgcodec
                    except Exception:  # not installed, or a build for another platform
                        nvimgcodec = None
            finally:
                os.dup2(saved, 2)
                os.close(saved)
            _nvimgcodec.append(nvimgcodec)
        return _nvimgcodec[0]


def _has_torchvision_decode() -> bool:
    try:
        from torchvision.io import decode_jpeg  # noqa: F401
    except Exception:  # not installed, or a build that does not load with this torch
        return False
    return True


def nvimgcodec_install_hint() -> str:
    """The command that installs nvImageCodec built for this torch's CUDA (12 or 13)."""
    import torch

    if (torch.version.cuda or "").split(".")[0] == "13":
        return "pip install nvidia-nvimgcodec-cu13 nvidia-nvjpeg (the gpu-cu13 extra)"
    return "pip install nvidia-nvimgcodec-cu12 nvidia-nvjpeg-cu12 (the gpu extra)"


def available_backends(device: torch.device | str = "cpu") -> list[str]:
    """The backends that can decode for ``device`` on this machine, best first (``cpu`` always
    last)."""
    import torch

    found = []
    if _load_nvimgcodec() is not None:
        found.append("nvimgcodec")
    if torch.device(device).type == "cuda" and _has_torchvision_decode():
        found.append("torchvision")
    return [*found, "cpu"]


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

    Raises:
        ValueError: an unknown backend, or one that cannot run here (the message says what
            to install).
    """

    def __init__(
        self, device: torch.device | str = "cpu", *, backend: str = "auto", fast: bool = False
    ) -> None:
        import torch

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
        return f"DeviceDecoder(device={str(self.device)!r}, backend={self.backend!r})"

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
            for k, i in enumerate(group):
                region, regions[k] = regions[k], None  # each window freed once finished
                if region is None:
                    on_cpu += 1
                    try:
                        hwc = torch.from_numpy(render(datas[i], plans[i], self.fast))
                    except CorruptImageError as exc:  # which image of the batch, for the caller
                        raise BatchImageError(i, exc) from exc
                    batch[i].copy_(hwc.permute(2, 0, 1), non_blocking=True)
                else:
                    batch[i] = _finish(region, plans[i])
        return batch, on_cpu

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

        nv = _load_nvimgcodec()
        cuda = self.device.type == "cuda"
        if self._codec is None:
            if cuda:
                self._codec = nv.Decoder(device_id=self.device.index or 0)
            else:
                cpu = [nv.Backend(nv.BackendKind.CPU_ONLY)]
                self._codec = nv.Decoder(device_id=nv.NVIMGCODEC_DEVICE_CPU_ONLY, backends=cpu)
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
            y0, x0, y1, x1 = plan.pixels(*plan.full)
            streams.append(
                stream.get_sub_code_stream(region=nv.Region(start=(y0, x0), end=(y1, x1)))
            )
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
            images = iter(self._codec.decode(valid, **kwargs) if valid else [])
        except Exception:  # the whole call failed: each image goes through the CPU pipeline
            images = iter([None] * len(valid))
        out: list[Any] = []
        for stream in streams:
            image = next(images) if stream is not None else None
            if image is None:
                out.append(None)
            elif cuda:
                out.append(torch.from_dlpack(image).permute(2, 0, 1))
            else:
                hwc = np.asarray(image.cpu())
                out.append(torch.from_numpy(hwc).permute(2, 0, 1).to(self.device))
        return out

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


def _finish(region: torch.Tensor, plan: CropPlan) -> torch.Tensor:
    """A decoded window (``3 x h x w`` uint8) resized to the plan's output, flipped and
    jittered: ``3 x H x W`` uint8."""
    import torch
    import torch.nn.functional as F

    x = _reduce(region, plan.out).unsqueeze(0)
    if tuple(x.shape[2:]) != plan.out:
        x = F.interpolate(x, size=plan.out, mode="bilinear", antialias=True, align_corners=False)
        x = x.round_().clamp_(0, 255)
    x = x[0]
    if plan.flip:
        x = x.flip(2)
    for op, factor in plan.jitter:  # as pipelines.color_jitter, on the device
        if op == 0:
            other: torch.Tensor | float = 0.0
        else:
            gray = (x[0] * 0.2989 + x[1] * 0.587 + x[2] * 0.114).floor_()
            other = gray.mean() if op == 1 else gray.unsqueeze(0)
        x = (factor * x + (1 - factor) * other).clamp_(0, 255).floor_()
    return x.to(torch.uint8)


class Planned(Pipeline):
    """A pipeline's plans without its pixels: ``(encoded bytes, plan, index)`` per sample, what
    a loader's workers hand to a :class:`DeviceDecoder` (``create_loader(decode="device")``).

    Args:
        pipeline: a pipeline whose ``plan`` says all that its ``__call__`` does (the built-in
            ones, and subclasses that leave ``__call__`` alone).

    Raises:
        ValueError: a pipeline the device cannot follow.
    """

    wants_index = True  # the dataset passes each sample's index (errors name the record)

    def __init__(self, pipeline: Pipeline) -> None:
        if type(pipeline).__call__ not in _FOLLOWED:
            raise ValueError(
                f"decode='device' follows a pipeline's plan(), and {type(pipeline).__name__} "
                "has none or does more in its own __call__: use TrainPipeline or EvalPipeline "
                "(or a subclass that changes only their options), or decode='cpu'"
            )
        self.pipeline = pipeline
        self.size = pipeline.size

    def plan(self, data: bytes, seed: int | None = None) -> CropPlan:
        return self.pipeline.plan(data, seed)

    def __call__(self, data: bytes, seed: int | None = None, index: int = -1) -> Any:
        return bytes(data), self.pipeline.plan(data, seed), index

    def __repr__(self) -> str:
        return f"Planned({self.pipeline!r})"


_FOLLOWED = (pipelines.TrainPipeline.__call__, pipelines.EvalPipeline.__call__)
"""The ``__call__`` s whose work is all in their ``plan`` (and :func:`render`)."""


def _reduce(region: torch.Tensor, out: tuple[int, int]) -> torch.Tensor:
    """``region`` (``3 x h x w`` uint8) as float32, averaged over ``k x k`` blocks first where it
    is at least twice the output (as the CPU path decodes such a crop at 1/k of its size), a
    strip of rows at a time: the float copy of a large window is never made whole."""
    import torch
    import torch.nn.functional as F

    _, h, w = region.shape
    k = pipelines._shrink_for(h, w, *out)  # the CPU path's rule
    if k == 1:
        return region.to(torch.float32)
    rows = STRIP_ROWS * k
    strips = [
        F.avg_pool2d(region[:, y : y + rows].to(torch.float32).unsqueeze(0), k, ceil_mode=True)[0]
        for y in range(0, h, rows)
    ]
    return torch.cat(strips, dim=1)
