"""A custom model's name and its safetensors file, from a state dict.

A federation started with ``estuary-server serve --initial-model FILE`` knows
the model only as named tensors. Its name is ``custom@`` and 12 hex digits of
its layout's SHA-256 (docs/CUSTOM_MODELS.md); the file is written and read by
the same C++ code the server uses (models/custom_model.h).

A state dict here is a mapping of names to torch tensors or NumPy arrays, or
anything with a ``state_dict()`` method (a ``torch.nn.Module``).
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Mapping, Tuple, Union

import numpy as np

from . import _estuary

StateDict = Union[Mapping[str, Any], Any]

# Safetensors' dtype names.
_NUMPY_NAMES = {
    np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(np.float64): "F64",
    np.dtype(np.int8): "I8", np.dtype(np.int16): "I16", np.dtype(np.int32): "I32", np.dtype(np.int64): "I64",
    np.dtype(np.uint8): "U8", np.dtype(np.uint16): "U16", np.dtype(np.uint32): "U32", np.dtype(np.uint64): "U64",
    np.dtype(np.bool_): "BOOL",
}
_NUMPY_OF = {name: dtype for dtype, name in _NUMPY_NAMES.items()}
_TORCH_NAMES = {
    "float32": "F32", "bfloat16": "BF16", "float16": "F16", "float64": "F64", "int8": "I8", "int16": "I16",
    "int32": "I32", "int64": "I64", "uint8": "U8", "bool": "BOOL",
}
_TORCH_OF = {name: dtype for dtype, name in _TORCH_NAMES.items()}
FEDERATED = ("F32", "BF16", "F16")


def is_torch(value: Any) -> bool:
    """Whether ``value`` is a torch tensor (without importing torch)."""
    return type(value).__module__.startswith("torch") and hasattr(value, "detach")


def state_items(state: StateDict) -> List[Tuple[str, Any]]:
    """The (name, tensor) pairs of a state dict or of a module's."""
    if not isinstance(state, Mapping) and callable(getattr(state, "state_dict", None)):
        state = state.state_dict()
    if not isinstance(state, Mapping):
        raise TypeError(f"expected a state dict (a mapping of names to tensors) or a module, got {type(state).__name__}")
    return [(str(name), value) for name, value in state.items()]


def dtype_name(name: str, value: Any) -> str:
    """The safetensors dtype name ("F32", "BF16", "I64", ...) of a tensor."""
    if is_torch(value):
        dtype = str(value.dtype).replace("torch.", "")
        if dtype in _TORCH_NAMES:
            return _TORCH_NAMES[dtype]
    else:
        dtype = np.asarray(value).dtype
        if dtype in _NUMPY_NAMES:
            return _NUMPY_NAMES[dtype]
    raise ValueError(f"tensor '{name}': dtype {dtype} has no safetensors name the federation reads")


def shape_of(value: Any) -> List[int]:
    return [int(d) for d in (value.shape if hasattr(value, "shape") else np.asarray(value).shape)]


def as_float32(value: Any) -> np.ndarray:
    """A C-contiguous float32 NumPy array of a tensor's values: no copy when it is one already."""
    if is_torch(value):
        value = value.detach()
        if str(value.dtype) != "torch.float32":
            value = value.float()
        return value.cpu().contiguous().numpy()
    return np.ascontiguousarray(value, dtype=np.float32)


def _raw_bytes(value: Any) -> bytes:
    """A held (integer, bool or empty) tensor's bytes, little-endian, as safetensors stores them."""
    if is_torch(value):
        value = value.detach().cpu()
        if value.numel() == 0:
            return b""
        value = value.contiguous().numpy()
    array = np.ascontiguousarray(value)
    return array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes()


def model_name(state: StateDict) -> str:
    """The name a federation gives this model: ``custom@`` + 12 hex digits.

    Every tensor counts, integer buffers included, whatever its order. Pass it
    as ``Client(expected_model=...)`` to refuse a federation of another model.
    """
    layout = [(name, shape_of(v), dtype_name(name, v)) for name, v in state_items(state)]
    return _estuary.model_name(layout)


def save_model(path: Union[str, os.PathLike], state: StateDict) -> str:
    """Writes ``state`` as the safetensors file ``estuary-server serve --initial-model`` reads; returns its name.

    F32, F16 and BF16 tensors are federated (BF16 only as torch tensors: NumPy
    has no bfloat16); integer and bool tensors, and empty ones, are held by
    the server as they are. A float64 tensor is refused: convert it first.
    """
    path = os.fspath(path)
    tensors = []
    for name, value in state_items(state):
        dtype = dtype_name(name, value)
        if dtype == "F64":
            raise ValueError(f"{path}: tensor '{name}' is float64, which the federation refuses: convert it to float32")
        shape = shape_of(value)
        federated = dtype in FEDERATED and int(np.prod(shape, dtype=np.int64)) > 0
        tensors.append((name, dtype, shape, as_float32(value) if federated else _raw_bytes(value)))
    try:
        _estuary.save_model(path, tensors)
    except RuntimeError as e:
        raise OSError(str(e)) from None
    return _estuary.model_name([(n, s, d) for n, d, s, _ in tensors])


def load_model(path: Union[str, os.PathLike], as_torch: bool = False) -> Dict[str, Any]:
    """Reads a model file (an ``--initial-model``, or ``estuary-server export``'s model.safetensors).

    Returns name -> NumPy array of the file's dtype (BF16 widened exactly to
    float32), or with ``as_torch`` name -> torch tensor of the file's dtype,
    ready for ``module.load_state_dict``.
    """
    path = os.fspath(path)
    try:
        _, tensors = _estuary.load_model(path)
    except RuntimeError as e:
        raise ValueError(str(e)) from None
    out: Dict[str, Any] = {}
    for name, dtype, shape, value in tensors:
        if isinstance(value, bytes):
            if dtype == "BF16":  # only an empty one is held
                array = np.zeros(shape, dtype=np.float32)
            else:
                array = np.frombuffer(value, dtype=_NUMPY_OF[dtype].newbyteorder("<")).astype(_NUMPY_OF[dtype])
                array = array.reshape(shape)
        else:
            array = value.reshape(shape)
            if dtype == "F16":
                array = array.astype(np.float16)  # exact: the values were read from F16
        if as_torch:
            import torch

            tensor = torch.from_numpy(np.array(array))
            out[name] = tensor.to(getattr(torch, _TORCH_OF[dtype])) if dtype == "BF16" else tensor
        else:
            out[name] = array
    return out
