"""GGUF header metadata: the key/value fields of a .gguf file, read without decoding its tensors.

HF config and tokenizer building (transformers_utils) and the GGUF weight reader (models/weight_utils.py) all read
these fields.
"""
from __future__ import annotations


_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def read_gguf_metadata(gguf_path: str, keys: set[str] | frozenset[str] | None = None) -> dict:
    """The GGUF header's key/value metadata (only `keys` when given), read directly from the file.

    gguf.GGUFReader decodes every field, which takes ~2 s for a 49k-token vocabulary; this walks the header and
    skips what is not asked for (~50 ms). Array values come back as lists. Falls back to GGUFReader for files this
    reader does not understand (GGUF v1, big-endian).
    """
    header = _read_header(gguf_path, keys, with_tensors=False)
    return header[0] if header is not None else _read_gguf_metadata_slow(gguf_path, keys)


def _read_header(gguf_path: str, keys, with_tensors: bool):
    """(metadata, {tensor name: (ggml type id, HF-order shape, data offset)}, byte where the tensor data starts),
    the table empty unless with_tensors; None for a file this walk does not understand."""
    import mmap
    import struct

    with open(gguf_path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF" or struct.unpack_from("<I", buf, 4)[0] not in (2, 3):
            return None
        n_kv = struct.unpack_from("<Q", buf, 16)[0]
        off = 24
        out = {}

        def read_string(off: int) -> tuple[str, int]:
            (n,) = struct.unpack_from("<Q", buf, off)
            return buf[off + 8 : off + 8 + n].decode("utf-8", errors="replace"), off + 8 + n

        def read_value(vtype: int, off: int, want: bool):
            if vtype == _GGUF_STRING:
                if want:
                    return read_string(off)
                return None, off + 8 + struct.unpack_from("<Q", buf, off)[0]
            if vtype in _GGUF_SCALARS:
                fmt = _GGUF_SCALARS[vtype]
                return (struct.unpack_from(fmt, buf, off)[0] if want else None), off + struct.calcsize(fmt)
            if vtype == _GGUF_ARRAY:
                etype, count = struct.unpack_from("<IQ", buf, off)
                off += 12
                if etype in _GGUF_SCALARS and not want:
                    return None, off + count * struct.calcsize(_GGUF_SCALARS[etype])
                items = []
                for _ in range(count):
                    item, off = read_value(etype, off, want)
                    items.append(item)
                return (items if want else None), off
            raise ValueError(f"unknown GGUF value type {vtype}")

        align = 32   # general.alignment's default
        for _ in range(n_kv):
            key, off = read_string(off)
            (vtype,) = struct.unpack_from("<I", buf, off)
            want = keys is None or key in keys or key == "general.alignment"
            value, off = read_value(vtype, off + 4, want)
            if key == "general.alignment":
                align = int(value)
            if keys is None or key in keys:
                out[key] = value
        tensors = {}
        if with_tensors:
            for _ in range(struct.unpack_from("<Q", buf, 8)[0]):
                name, off = read_string(off)
                (n_dims,) = struct.unpack_from("<I", buf, off)
                dims = struct.unpack_from(f"<{n_dims}Q", buf, off + 4)
                off += 4 + 8 * n_dims
                ttype, data_off = struct.unpack_from("<IQ", buf, off)
                off += 12
                tensors[name] = (int(ttype), tuple(int(d) for d in reversed(dims)), int(data_off))
        # The tensor data starts at the next multiple of general.alignment after the header.
        return out, tensors, -(-off // align) * align


def read_gguf_tensor_infos(gguf_path: str) -> dict[str, tuple[int, tuple[int, ...]]]:
    """{GGUF tensor name: (ggml type id, shape in HF order, outermost first)} from the header, without the data."""
    header = _read_header(gguf_path, frozenset(), with_tensors=True)
    if header is None:  # a file only GGUFReader reads
        import gguf
        return {t.name: (int(t.tensor_type), tuple(int(d) for d in reversed(t.shape.tolist())))
                for t in gguf.GGUFReader(gguf_path).tensors}
    return {name: (ttype, shape) for name, (ttype, shape, _) in header[1].items()}


def read_gguf_tensors(gguf_path: str, keys: set[str] | frozenset[str] | None = None
                      ) -> tuple[dict, list[tuple[str, int, tuple[int, ...], object]]] | None:
    """(metadata, [(GGUF tensor name, ggml type id, shape in HF order, raw bytes)]) with each tensor's bytes a
    read-only uint8 numpy view [rows, bytes per row] of a memory map of the file (rows: the product of every
    dimension but the innermost), the form gguf.quants.dequantize takes. The metadata holds `keys` (everything
    when None). None for a file only gguf.GGUFReader reads. Unlike GGUFReader it does not decode the tokenizer's
    fields (seconds for a 49k-token vocabulary)."""
    import gguf
    import numpy as np

    header = _read_header(gguf_path, keys, with_tensors=True)
    if header is None:
        return None
    meta, tensors, start = header
    mm = np.memmap(gguf_path, dtype=np.uint8, mode="r")
    out = []
    for name, (ttype, shape, data_off) in tensors.items():
        block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ttype)]
        inner = shape[-1] if shape else 1
        rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
        row_bytes = inner // block * type_size
        at = start + data_off
        out.append((name, ttype, shape, mm[at:at + rows * row_bytes].reshape(rows, row_bytes)))
    return meta, out


def _read_gguf_metadata_slow(gguf_path: str, keys) -> dict:
    import gguf

    reader = gguf.GGUFReader(gguf_path)
    return {
        k: gguf_field(reader, k)
        for k in reader.fields
        if not k.startswith("GGUF.") and (keys is None or k in keys)  # GGUF.*: the reader's own header fields
    }


def gguf_field(reader, key: str):
    """One metadata value from a gguf.GGUFReader, as a Python scalar, str or list."""
    field = reader.fields.get(key)
    if field is None:
        return None

    def decode(part, vtype):
        return bytes(part).decode("utf-8", errors="replace") if vtype.name == "STRING" else part[0].item()

    if field.types and field.types[0].name == "ARRAY":
        return [decode(field.parts[i], field.types[-1]) for i in field.data]
    return decode(field.parts[field.data[0]], field.types[0])
