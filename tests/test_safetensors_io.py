"""safetensors reading/writing: every DeepSeek dtype, interop with the `safetensors` package,
sharded checkpoints, and errors that name the broken file or tensor."""

import json
import struct

import ml_dtypes
import numpy as np
import pytest
import safetensors
import safetensors.numpy
from safetensors import safe_open

from model.safetensors_io import INDEX_NAME, read_tensors, write_sharded, write_tensors


def all_dtype_tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    f = rng.standard_normal((3, 5)).astype(np.float32)
    return {
        "f32": f,
        "f16": f.astype(np.float16),
        "bf16": f.astype(ml_dtypes.bfloat16),
        "f8_e4m3": f.astype(ml_dtypes.float8_e4m3fn),
        "f8_e5m2": f.astype(ml_dtypes.float8_e5m2),
        "f8_e8m0": np.arange(120, 135, dtype=np.uint8).reshape(3, 5).view(ml_dtypes.float8_e8m0fnu),
        "i8": np.arange(-8, 7, dtype=np.int8).reshape(3, 5),
        "u8": np.arange(250, 256, dtype=np.uint8),
        "i16": np.array([-30000, 1, 30000], np.int16),
        "i32": np.array([[-(2**31)], [2**31 - 1]], np.int32),
        "i64": np.array(2**40, np.int64),  # a scalar, shape ()
        "bool": np.array([True, False, True]),
        "empty": np.zeros((0, 4), np.float32),
    }


def assert_same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for name, w in want.items():
        g = got[name]
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert g.tobytes() == np.ascontiguousarray(w).tobytes(), name


def raw_file(path, header: dict, data: bytes = b"") -> None:
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)


def test_round_trip_every_dtype(tmp_path):
    tensors = all_dtype_tensors()
    write_tensors(tmp_path / "t.safetensors", tensors)
    assert_same(read_tensors(tmp_path / "t.safetensors"), tensors)
    assert_same(read_tensors(str(tmp_path)), tensors)  # a directory without an index


def test_header_layout(tmp_path):
    path = tmp_path / "t.safetensors"
    write_tensors(path, all_dtype_tensors(), metadata={"format": "np"})
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert n % 8 == 0
    header = json.loads(raw[8:8 + n])
    assert header.pop("__metadata__") == {"format": "np"}
    assert {k: v["dtype"] for k, v in header.items()} == {
        "f32": "F32", "f16": "F16", "bf16": "BF16", "f8_e4m3": "F8_E4M3", "f8_e5m2": "F8_E5M2",
        "f8_e8m0": "F8_E8M0", "i8": "I8", "u8": "U8", "i16": "I16", "i32": "I32", "i64": "I64",
        "bool": "BOOL", "empty": "F32"}
    offsets = [header[k]["data_offsets"] for k in sorted(header)]  # laid out in sorted-name order
    assert offsets[0][0] == 0 and all(a[1] == b[0] for a, b in zip(offsets, offsets[1:]))
    assert offsets[-1][1] == len(raw) - 8 - n
    for pad in range(8):  # the data must start 8-byte aligned whatever the header's length
        write_tensors(path, {"x": np.zeros(1, np.float32)}, metadata={"m": "x" * pad})
        assert struct.unpack("<Q", path.read_bytes()[:8])[0] % 8 == 0


def test_big_endian_input_is_stored_little_endian(tmp_path):
    write_tensors(tmp_path / "t.safetensors", {"x": np.array([1.0, -2.5], ">f4")})
    got = read_tensors(tmp_path / "t.safetensors")["x"]
    assert got.dtype == np.dtype("<f4")
    np.testing.assert_array_equal(got, [1.0, -2.5])


def test_reads_files_written_by_safetensors_numpy(tmp_path):
    tensors = {k: v for k, v in all_dtype_tensors().items() if v.dtype in (np.float32, np.float16, np.int8,
                                                                         np.uint8, np.int64, np.bool_)}
    safetensors.numpy.save_file(tensors, tmp_path / "ref.safetensors", metadata={"a": "b"})
    assert_same(read_tensors(tmp_path / "ref.safetensors"), tensors)


def test_reads_torch_layout_dtypes_serialized_by_safetensors(tmp_path):
    # The dtype names are torch's; safetensors' serializer maps them to BF16 / F8_E4M3 / F8_E8M0.
    tensors = {k: all_dtype_tensors()[k] for k in ("bf16", "f8_e4m3", "f8_e8m0")}
    torch_names = {"bf16": "bfloat16", "f8_e4m3": "float8_e4m3fn", "f8_e8m0": "float8_e8m0fnu"}
    specs = {k: safetensors.TensorSpec(dtype=torch_names[k], shape=list(v.shape), data_ptr=v.ctypes.data,
                                       data_len=v.nbytes) for k, v in tensors.items()}
    (tmp_path / "ref.safetensors").write_bytes(bytes(safetensors.serialize(specs)))
    assert_same(read_tensors(tmp_path / "ref.safetensors"), tensors)


def test_written_files_are_read_by_safetensors(tmp_path):
    tensors = all_dtype_tensors()
    path = tmp_path / "t.safetensors"
    write_tensors(path, tensors, metadata={"k": "v"})
    with safe_open(path, framework="numpy") as f:
        assert f.metadata() == {"k": "v"}
        for name in ("f32", "f16", "i8", "u8", "i16", "i32", "i64", "bool", "empty"):
            got = f.get_tensor(name)
            assert got.dtype == tensors[name].dtype and got.shape == tensors[name].shape, name
            assert got.tobytes() == tensors[name].tobytes(), name
    # dtypes its numpy backend cannot represent: check the raw bytes its parser finds.
    parsed = dict(safetensors.deserialize(path.read_bytes()))
    for name, dtype in [("bf16", "BF16"), ("f8_e4m3", "F8_E4M3"), ("f8_e5m2", "F8_E5M2"), ("f8_e8m0", "F8_E8M0")]:
        assert parsed[name]["dtype"] == dtype
        assert bytes(parsed[name]["data"]) == tensors[name].tobytes(), name


def test_sharded_round_trip(tmp_path):
    tensors = {f"layer.{i}.w": np.full((4, 8), i, np.float32) for i in range(5)}  # 128 bytes each
    tensors["scale"] = np.ones((2, 2), ml_dtypes.bfloat16)  # 8 bytes, sorts last
    paths = write_sharded(tmp_path, tensors, max_shard_bytes=300)
    names = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert [p.name for p in paths] == names
    assert not (tmp_path / "model.safetensors").exists()
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    assert index["metadata"]["total_size"] == 5 * 128 + 8
    assert index["weight_map"] == {"layer.0.w": names[0], "layer.1.w": names[0], "layer.2.w": names[1],
                                   "layer.3.w": names[1], "layer.4.w": names[2], "scale": names[2]}
    assert_same(read_tensors(tmp_path), tensors)


def test_sharded_single_file_when_it_fits(tmp_path):
    tensors = {"a": np.arange(6, dtype=np.int32), "b": np.ones(3, ml_dtypes.float8_e4m3fn)}
    assert write_sharded(tmp_path / "ckpt", tensors, max_shard_bytes=1 << 20) == [tmp_path / "ckpt" / "model.safetensors"]
    assert not (tmp_path / "ckpt" / INDEX_NAME).exists()
    assert_same(read_tensors(tmp_path / "ckpt"), tensors)


# ---- errors ---------------------------------------------------------------------------------

def test_missing_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.safetensors"):
        read_tensors(tmp_path / "nope.safetensors")
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors files"):
        read_tensors(tmp_path)


def test_truncated_data_names_file_and_tensor(tmp_path):
    path = tmp_path / "t.safetensors"
    write_tensors(path, {"a": np.zeros(4, np.float32), "b": np.zeros(4, np.float32)})
    path.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(ValueError, match=r"t\.safetensors: tensor 'b' has data_offsets \[16, 32\] outside"):
        read_tensors(path)


def test_truncated_header(tmp_path):
    path = tmp_path / "t.safetensors"
    path.write_bytes(b"\x01\x02")
    with pytest.raises(ValueError, match=r"t\.safetensors: truncated"):
        read_tensors(path)
    write_tensors(path, {"a": np.zeros(4, np.float32)})
    path.write_bytes(path.read_bytes()[:20])
    with pytest.raises(ValueError, match=r"t\.safetensors: truncated safetensors file: header claims"):
        read_tensors(path)


def test_corrupt_headers(tmp_path):
    path = tmp_path / "t.safetensors"
    raw_file(path, {"w": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, bytes(8))
    with pytest.raises(ValueError, match=r"tensor 'w' has data_offsets \[4, 12\] outside the 8 data bytes"):
        read_tensors(path)
    raw_file(path, {"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, bytes(8))
    with pytest.raises(ValueError, match=r"tensor 'w' spans 8 bytes, but shape \(3,\) of F32 needs 12"):
        read_tensors(path)
    raw_file(path, {"w": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}}, bytes(1))
    with pytest.raises(ValueError, match=r"t\.safetensors: tensor 'w' has unknown dtype 'F4'"):
        read_tensors(path)
    raw_file(path, {"w": {"dtype": "F32", "shape": [2]}}, bytes(8))
    with pytest.raises(ValueError, match="malformed header entry for tensor 'w'"):
        read_tensors(path)
    path.write_bytes(struct.pack("<Q", 4) + b"{{{{")
    with pytest.raises(ValueError, match=r"t\.safetensors: safetensors header is not valid JSON"):
        read_tensors(path)


def test_index_names_tensor_absent_from_shard(tmp_path):
    write_sharded(tmp_path, {"a": np.zeros(8, np.float32), "b": np.zeros(8, np.float32)}, max_shard_bytes=32)
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    index["weight_map"]["ghost"] = "model-00002-of-00002.safetensors"
    (tmp_path / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(ValueError, match="tensor 'ghost' is listed in .* under model-00002-of-00002.safetensors"):
        read_tensors(tmp_path)
    index["weight_map"]["ghost"] = "model-00003-of-00002.safetensors"
    (tmp_path / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="shard model-00003-of-00002.safetensors, which is missing"):
        read_tensors(tmp_path)


def test_write_rejects_unsupported_dtype(tmp_path):
    with pytest.raises(TypeError, match="tensor 'c' has dtype complex128"):
        write_tensors(tmp_path / "t.safetensors", {"c": np.zeros(2, np.complex128)})
