"""One generic safetensors loader; per-model differences are name maps (data), never code.

A checkpoint tensor name goes through `NameMap.renames` (prefix substitutions), then, if its last
module name is a packed part (e.g. `q_proj` of `qkv_proj`), it is loaded into its rows of the packed
parameter. Every parameter must be covered, or loading fails naming the missing checkpoint tensor.

Tensor parallel: a module that holds one rank's slice of a tensor (tandem.parallel.layers.ShardedModule) says which
slice per parameter (`ShardSpec`), and only that slice is read from the file; each rank reads its own.

Quantized checkpoints (config.json's quantization_config): before any name map sees them, a quantized module's stored
parts become one `X.weight` (tandem.weights.quantized). A Linear that `keep_stored` gave its stored form
(tandem.layers.stored) before the model was materialized loads its rank's slice of the stored parts; any other
module, or every one with --dequantize, loads the weight dequantized to the serving dtype.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors import safe_open
from torch import nn

from tandem.errors import StartupError
from tandem.layers.linear import PackedLinear
from tandem.layers.matmul import Linear
from tandem.layers.stored import StoredWeight
from tandem.parallel.layers import ShardedModule, ShardSpec
from tandem.weights.formats import QuantizationError, QuantizedTensor, Stored, stored_slices
from tandem.weights.quantized import quantization_of, quantized_entries

LOG = logging.getLogger(__name__)


class CheckpointError(StartupError):
    """A checkpoint that does not fit the model; the message names the tensor."""


# checkpoint module name -> (our packed module name, part)
PACKED_PARTS: dict[str, tuple[str, str]] = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}

# MLA's q and kv down projections, for a model that runs them as one matmul (the EAGLE3 MLA head; the DeepSeek-V3
# target keeps them apart). Rows: q_a_proj's first, then kv_a_proj_with_mqa's.
MLA_A_PROJECTION_PARTS: dict[str, tuple[str, str]] = {
    "q_a_proj": ("fused_qkv_a_proj_with_mqa", "q_a"),
    "kv_a_proj_with_mqa": ("fused_qkv_a_proj_with_mqa", "kv_a"),
}


@dataclass(frozen=True)
class NameMap:
    renames: tuple[tuple[str, str], ...] = ()  # (checkpoint prefix, parameter prefix), first match wins
    packed: dict[str, tuple[str, str]] = field(default_factory=lambda: dict(PACKED_PARTS))

    def to_parameter(self, name: str) -> tuple[str, str | None]:
        """Checkpoint name -> (parameter name, packed part or None)."""
        for source, target in self.renames:
            if name.startswith(source):
                name = target + name[len(source) :]
                break
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] in self.packed:
            packed_module, part = self.packed[parts[-2]]
            return ".".join([*parts[:-2], packed_module, parts[-1]]), part
        return name, None

    def to_checkpoint(self, parameter: str, part: str | None, present_roots: Collection[str] = ()) -> str:
        """Parameter name (and part) -> the checkpoint name it is expected under; for error messages.

        Several spellings may lead to one parameter (midlayer.* and layers.0.*, fc_norm.0.* and aux_norm_low.*):
        the first whose leading name component the checkpoint uses (`present_roots`) is named, else the first.
        """
        if part is not None:
            *modules, _, leaf = parameter.split(".")
            module = next(k for k, (_, p) in self.packed.items() if p == part)
            parameter = ".".join([*modules, module, leaf])
        spellings = [
            source + parameter[len(target) :] for source, target in self.renames if parameter.startswith(target)
        ]
        if not spellings or not any(parameter.startswith(source) for source, _ in self.renames):
            spellings.append(parameter)
        return next((name for name in spellings if name.split(".")[0] in present_roots), spellings[0])


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise CheckpointError(f"{index}: not valid JSON ({error})") from None
        except (KeyError, TypeError, AttributeError):
            raise CheckpointError(f"{index}: no weight_map of tensor names to file names") from None
        return [model_dir / name for name in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {model_dir}")
    return files


class StoredTensor:
    """A checkpoint tensor not read yet: its shape, and a read of the whole tensor or of one slice."""

    def __init__(self, handle: Any, name: str) -> None:  # handle: an open safetensors file
        self._handle = handle
        self._name = name
        stored = handle.get_slice(name)
        self.shape: tuple[int, ...] = tuple(stored.get_shape())
        self.dtype: str = stored.get_dtype()  # safetensors' name, e.g. "BF16", "F8_E4M3"

    def read(self, spec: ShardSpec | None = None) -> torch.Tensor:
        if spec is None or spec.size is None:
            return self._handle.get_tensor(self._name)
        index = [slice(None)] * len(self.shape)
        index[spec.dim] = slice(spec.start, spec.start + spec.size)
        return self._handle.get_slice(self._name)[tuple(index)]


@contextmanager
def checkpoint_tensors(
    model_dir: Path, skip: Callable[[str], bool] | None = None, dtype: torch.dtype = torch.float32
) -> Iterator[list[tuple[str, Stored]]]:
    """Every tensor of the checkpoint, except those whose name `skip` accepts, none read yet; the files stay open
    until the context ends, since a weight and its scales may lie in different files. A quantized module's weight
    comes as one QuantizedTensor, whose float values come in `dtype` (the serving dtype)."""
    config = model_dir / "config.json"
    quantization = quantization_of(json.loads(config.read_text())) if config.is_file() else None
    with ExitStack() as files:
        stored: list[tuple[str, Stored]] = []
        for path in checkpoint_files(model_dir):
            handle = files.enter_context(safe_open(str(path), framework="pt"))
            for name in handle.keys():  # noqa: SIM118 - safe_open handles are not iterable
                if skip is None or not skip(name):
                    stored.append((name, StoredTensor(handle, name)))
        yield quantized_entries(stored, quantization, str(model_dir), dtype)


def iter_tensors(
    model_dir: Path, skip: Callable[[str], bool] | None = None, dtype: torch.dtype = torch.float32
) -> Iterator[tuple[str, Stored]]:
    """`checkpoint_tensors` one by one, the files open until the iteration ends."""
    with checkpoint_tensors(model_dir, skip, dtype) as tensors:
        yield from tensors


@dataclass(frozen=True)
class Slot:
    """Where one checkpoint tensor goes: a parameter (or buffer), its packed part, and what of the tensor this rank
    holds."""

    parameter_name: str
    part: str | None  # the packed part (tandem.layers.linear.PackedLinear), None for a whole parameter
    full_shape: tuple[int, ...]  # the checkpoint tensor's expected shape, all ranks' slices together
    spec: ShardSpec | None  # this rank's slice; None: a module that is not sharded takes the whole tensor

    @property
    def key(self) -> tuple[str, str | None]:
        return self.parameter_name, self.part


class ParameterSlots:
    """A module's parameters and buffers as a checkpoint fills them: which checkpoint name goes where (through the
    name map and the modules' shard specs), and what is still missing."""

    def __init__(self, module: nn.Module, name_map: NameMap) -> None:
        self.name_map = name_map
        self.parameters = dict(module.named_parameters()) | dict(module.named_buffers())
        self.modules = dict(module.named_modules())
        expected: set[tuple[str, str | None]] = set()
        for name in self.parameters:
            owner_name = name.rpartition(".")[0]
            owner = self.modules[owner_name]
            if isinstance(owner, StoredWeight):  # a stored part: loaded under its layer's weight (below)
                continue
            if isinstance(owner, PackedLinear):
                expected.update((name, part) for part in owner.part_rows)
            else:
                expected.add((name, None))
        for name, layer in self.modules.items():  # a weight kept as stored: its segments, as a PackedLinear's parts
            if isinstance(layer, Linear) and layer.stored is not None:
                expected.update((f"{name}.weight", segment) for segment in layer.stored.segments)
        self.expected = frozenset(expected)

    def slot(self, checkpoint_name: str) -> Slot | None:
        """Where the tensor `checkpoint_name` goes; None when no parameter takes it."""
        parameter_name, part = self.name_map.to_parameter(checkpoint_name)
        if (parameter_name, part) not in self.expected:
            return None
        owner_name, _, leaf = parameter_name.rpartition(".")
        owner = self.modules[owner_name]
        if isinstance(owner, ShardedModule):
            spec = owner.shard_spec(leaf, part)
            return Slot(parameter_name, part, spec.full_shape, spec)
        if parameter_name not in self.parameters:  # a weight kept as stored
            assert isinstance(owner, Linear) and owner.stored is not None
            return Slot(parameter_name, part, owner.stored.shape, None)
        return Slot(parameter_name, part, tuple(self.parameters[parameter_name].shape), None)

    def check_filled(
        self,
        filled: Collection[tuple[str, str | None]],
        optional: frozenset[str],
        present_roots: Collection[str],
        source: str,
    ) -> None:
        """Raises CheckpointError naming the checkpoint tensors of the parameters not `filled` (except `optional`
        ones); `present_roots`: the leading name components of the checkpoint's tensors, to name them as it would."""
        missing = sorted(
            self.name_map.to_checkpoint(name, part, present_roots)
            for name, part in self.expected - set(filled)
            if name not in optional
        )
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise CheckpointError(f"missing tensor {shown} in {source}")


def load_weights(
    module: nn.Module,
    tensors: Iterator[tuple[str, Stored]],
    name_map: NameMap,
    source: str,
    optional: frozenset[str] = frozenset(),
) -> list[str]:
    """Loads tensors into module's parameters and persistent buffers; returns the unused checkpoint names.

    Raises CheckpointError naming the tensor on a shape mismatch or a missing tensor; names in
    `optional` may be absent (the caller fills them another way).
    """
    slots = ParameterSlots(module, name_map)
    filled: set[tuple[str, str | None]] = set()
    unused = []
    present_roots: set[str] = set()  # leading name components of the checkpoint's tensors, to name missing ones
    for checkpoint_name, stored in tensors:
        present_roots.add(checkpoint_name.split(".")[0])
        slot = slots.slot(checkpoint_name)
        if slot is None or slot.key in filled:
            unused.append(checkpoint_name)
            continue
        try:
            if stored.shape != slot.full_shape:
                raise ValueError(f"expected shape {slot.full_shape}, got {stored.shape}")
            owner_name, _, leaf = slot.parameter_name.rpartition(".")
            owner = slots.modules[owner_name]
            if isinstance(owner, Linear) and owner.stored is not None:
                assert isinstance(stored, QuantizedTensor), "keep_stored keeps only weights stored quantized"
                owner.stored.load(slot.part, stored.read_stored(slot.spec))
            elif slot.part is None:
                slots.parameters[slot.parameter_name].data.copy_(stored.read(slot.spec))
            else:
                assert isinstance(owner, PackedLinear)
                owner.load_part(leaf, slot.part, stored.read(slot.spec))
        except ValueError as error:
            raise CheckpointError(f"tensor {checkpoint_name} in {source}: {error}") from None
        filled.add(slot.key)
    slots.check_filled(filled, optional, present_roots, source)
    return unused


def keep_stored(
    module: nn.Module, tensors: Sequence[tuple[str, Stored]], name_map: NameMap, dtype: torch.dtype, device: str
) -> None:
    """Gives every Linear of `module` (still on the meta device) whose weight the checkpoint stores quantized its
    stored form in place of the float weight, which is then never materialized. A quantized weight of any other
    module (an embedding) loads dequantized. Raises QuantizationError naming a weight whose rank slice would cut a
    block or group (tandem.weights.formats.stored_slices), or a packed layer of quantized and float parts."""
    slots = ParameterSlots(module, name_map)
    found: dict[str, dict[str | None, QuantizedTensor]] = {}  # layer name -> its quantized parts
    for name, stored in tensors:
        slot = slots.slot(name)
        if slot is None or not isinstance(stored, QuantizedTensor):
            continue
        owner_name, _, leaf = slot.parameter_name.rpartition(".")
        if leaf == "weight" and isinstance(slots.modules[owner_name], Linear):
            stored_slices(stored.quantization, slot.spec, name)  # refuses a cut before anything is read
            found.setdefault(owner_name, {})[slot.part] = stored
    for owner_name, parts in found.items():
        owner = slots.modules[owner_name]
        assert isinstance(owner, Linear)
        experts = owner.experts if isinstance(owner, PackedLinear) else 1
        segments = _segments(owner)
        if set(parts) != set(segments):
            raise QuantizationError(
                f"{owner_name}: packs the quantized parts {sorted(map(str, parts))} with float ones (--dequantize)"
            )
        quantization = next(iter(parts.values())).quantization
        owner.keep_stored(StoredWeight(quantization, segments, owner.in_features, dtype, device, experts))


def _segments(layer: Linear) -> dict[str | None, int]:
    """A layer's stored segments and the rows of one expert each: a PackedLinear's parts, else the whole weight."""
    if isinstance(layer, PackedLinear):
        return {part: size // layer.experts for part, (_, size) in layer.part_rows.items()}
    return {None: layer.out_features}


Built = TypeVar("Built")
Materialized = TypeVar("Materialized", bound=nn.Module)


def on_meta(build: Callable[[], Built]) -> Built:
    """`build()` on the meta device, with torch.nn.init's initialisers skipped: every weight comes from the checkpoint
    (or a pull from the target). An initialiser on a meta tensor runs torch's Python reference of the operation, and
    its first call imports torch._dynamo: about 1 s of CPU added to every service's start-up for nothing."""
    names = [name for name in dir(nn.init) if name.endswith("_") and not name.startswith("_")]
    saved = {name: getattr(nn.init, name) for name in names}
    try:
        for name in names:
            setattr(nn.init, name, _untouched)
        with torch.device("meta"):
            return build()
    finally:
        for name, initialiser in saved.items():
            setattr(nn.init, name, initialiser)


def _untouched(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return tensor


def materialized(module: Materialized, device: str | torch.device, dtype: torch.dtype) -> Materialized:
    """A meta module's parameters and buffers as uninitialised tensors on `device`, the floating ones in `dtype`: what
    `to_empty(device=device).to(dtype)` gives, without torch.empty_like on meta tensors, whose Python reference
    imports sympy (about 0.35 s of CPU at every start-up)."""

    def empty(tensor: torch.Tensor) -> torch.Tensor:
        kind = dtype if tensor.is_floating_point() else tensor.dtype
        return torch.empty(tensor.shape, dtype=kind, device=device)

    return module._apply(empty)


def loaded_module(
    model_dir: Path,
    build: Callable[[], Materialized],
    names: NameMap,
    skip: Callable[[str], bool],
    dtype: torch.dtype,
    device: str | torch.device,
) -> Materialized:
    """A module `build` makes (on the meta device), on `device` in `dtype`, its tensors read from `model_dir`'s
    checkpoint but those `skip` accepts (another part's, such as the text model's), in eval mode: how a part of a
    checkpoint that is its own module (an image encoder) is loaded."""
    module = materialized(on_meta(build), device, dtype)
    with checkpoint_tensors(model_dir, skip, dtype) as tensors:
        load_weights(module, iter(tensors), names, source=str(model_dir))
    return module.eval()
