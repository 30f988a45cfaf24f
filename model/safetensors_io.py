"""Reading and writing safetensors files with numpy, including the bf16 / fp8 / e8m0 dtypes.

The safetensors layout: an 8-byte little-endian header length N, N bytes of JSON mapping each
tensor name to {"dtype", "shape", "data_offsets": [begin, end]} (offsets relative to the end of
the header, plus an optional "__metadata__" str->str map), then the raw little-endian data.
The header is parsed here rather than by the `safetensors` package because its numpy backend
cannot represent BF16, F8_E4M3 or F8_E8M0, all of which DeepSeek checkpoints use.
"""

import json
import math
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

DTYPES: dict[str, np.dtype] = {
    name: np.dtype(dt)
    for name, dt in {
        "F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": ml_dtypes.bfloat16,
        "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
        "F8_E8M0": ml_dtypes.float8_e8m0fnu,
        "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1",
        "U64": "<u8", "U32": "<u4", "U16": "<u2", "U8": "u1", "BOOL": np.bool_,
    }.items()
}
_NAMES = {dt: name for name, dt in DTYPES.items()}


def read_tensors(path: str | Path) -> dict[str, np.ndarray]:
    """Load every tensor of a checkpoint (directory, sharded or not, or one .safetensors file).

    Arrays are read-only views of memory-mapped files; copy one to modify it.
    """
    path = Path(path)
    if path.is_dir():
        return _read_dir(path)
    if not path.exists():
        raise FileNotFoundError(f"no safetensors file or checkpoint directory at {path}")
    return _read_file(path)


def _read_dir(directory: Path) -> dict[str, np.ndarray]:
    index = directory / INDEX_NAME
    if index.exists():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map")
        except (ValueError, AttributeError) as e:
            raise ValueError(f"{index} is not a JSON object: {e}") from e
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index} has no 'weight_map' object")
        out = {}
        for shard in sorted(set(weight_map.values())):
            shard_path = directory / shard
            if not shard_path.is_file():
                raise FileNotFoundError(f"{index} names shard {shard}, which is missing from {directory}")
            tensors = _read_file(shard_path)
            for name in (n for n, s in weight_map.items() if s == shard):
                if name not in tensors:
                    raise ValueError(f"tensor {name!r} is listed in {index} under {shard} "
                                     f"but absent from {shard_path}")
                out[name] = tensors[name]
        return out
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {directory}")
    out = {}
    for file in files:
        for name, array in _read_file(file).items():
            if name in out:
                raise ValueError(f"tensor {name!r} appears in more than one file of {directory}, again in {file}")
            out[name] = array
    return out


def _read_file(path: Path) -> dict[str, np.ndarray]:
    size = path.stat().st_size
    if size < 8:
        raise ValueError(f"{path}: truncated safetensors file ({size} bytes, less than the 8-byte header length)")
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        if 8 + header_len > size:
            raise ValueError(f"{path}: truncated safetensors file: header claims {header_len} bytes, "
                             f"only {size - 8} follow the length")
        raw = f.read(header_len)
    try:
        header = json.loads(raw)
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
        raise ValueError(f"{path}: safetensors header is not valid JSON: {e}") from e
    if not isinstance(header, dict):
        raise ValueError(f"{path}: safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    data_start, data_len = 8 + header_len, size - 8 - header_len
    file_map = np.memmap(path, dtype=np.uint8, mode="r")
    out = {}
    for name, info in header.items():
        dtype, shape, begin, end = _parse_entry(path, name, info)
        if not 0 <= begin <= end <= data_len:
            raise ValueError(f"{path}: tensor {name!r} has data_offsets [{begin}, {end}] outside the "
                             f"{data_len} data bytes of the file (truncated or corrupt)")
        needed = math.prod(shape) * dtype.itemsize
        if end - begin != needed:
            raise ValueError(f"{path}: tensor {name!r} spans {end - begin} bytes, but shape {shape} "
                             f"of {_NAMES[dtype]} needs {needed}")
        raw_bytes = np.asarray(file_map[data_start + begin:data_start + end])
        out[name] = raw_bytes.view(dtype).reshape(shape)
    return out


def _parse_entry(path: Path, name: str, info: object) -> tuple[np.dtype, tuple[int, ...], int, int]:
    try:
        dtype_name, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: malformed header entry for tensor {name!r}: {info!r}") from e
    if not isinstance(dtype_name, str) or dtype_name not in DTYPES:
        raise ValueError(f"{path}: tensor {name!r} has unknown dtype {dtype_name!r} "
                         f"(supported: {', '.join(DTYPES)})")
    ints = [*shape, begin, end] if isinstance(shape, list) else None
    if ints is None or not all(type(v) is int and v >= 0 for v in ints):
        raise ValueError(f"{path}: tensor {name!r} has a malformed shape {shape!r} "
                         f"or data_offsets {info['data_offsets']!r}")
    return DTYPES[dtype_name], tuple(shape), begin, end


def write_tensors(path: str | Path, tensors: dict[str, np.ndarray],
                  metadata: dict[str, str] | None = None) -> None:
    """Write `tensors` to one safetensors file, laid out in sorted-name order."""
    header: dict[str, object] = {}
    if metadata is not None:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise TypeError("safetensors metadata must map str to str")
        header["__metadata__"] = dict(metadata)
    arrays, offset = [], 0
    for name in sorted(tensors):
        array = np.asarray(tensors[name])
        if array.dtype.byteorder == ">":
            array = array.astype(array.dtype.newbyteorder("<"))
        if array.dtype not in _NAMES:
            raise TypeError(f"tensor {name!r} has dtype {array.dtype}, which safetensors cannot store "
                            f"(supported: {', '.join(map(str, _NAMES))})")
        header[name] = {"dtype": _NAMES[array.dtype], "shape": list(array.shape),
                        "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
        arrays.append(array)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # pad like the reference writer so data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for array in arrays:
            f.write(np.ascontiguousarray(array).reshape(-1).view(np.uint8))


def write_sharded(directory: str | Path, tensors: dict[str, np.ndarray], max_shard_bytes: int) -> list[Path]:
    """Write a checkpoint directory: `model.safetensors` if it fits in one shard, else
    `model-0000i-of-0000N.safetensors` shards plus `model.safetensors.index.json`.

    Tensors are packed greedily in sorted-name order; one larger than `max_shard_bytes` gets a
    shard of its own. Returns the paths of the safetensors files written.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    shards: list[list[str]] = [[]]
    shard_bytes = 0
    for name in sorted(tensors):
        nbytes = np.asarray(tensors[name]).nbytes
        if shards[-1] and shard_bytes + nbytes > max_shard_bytes:
            shards.append([])
            shard_bytes = 0
        shards[-1].append(name)
        shard_bytes += nbytes
    if len(shards) == 1:
        write_tensors(directory / SINGLE_NAME, tensors)
        return [directory / SINGLE_NAME]
    paths, weight_map = [], {}
    for i, names in enumerate(shards, 1):
        file_name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        write_tensors(directory / file_name, {name: tensors[name] for name in names})
        weight_map.update(dict.fromkeys(names, file_name))
        paths.append(directory / file_name)
    total = sum(np.asarray(t).nbytes for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return paths
