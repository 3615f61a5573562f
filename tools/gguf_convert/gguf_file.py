"""Reading a GGUF file for the converter: metadata fields by name (with required / default
handling), tensors dequantized to float32 (gguf.quants.dequantize), and the source's fingerprint
and model id. ConvertError is the converter's one error type."""
import hashlib
import os
import re

import numpy as np


class ConvertError(Exception):
    """A GGUF this converter cannot turn into a nanoVLM checkpoint, or a bad option."""


# --- GGUF metadata ------------------------------------------------------------------------------

_REQUIRED = object()


class GgufFile:
    """The metadata and tensors of one GGUF file (gguf.GGUFReader, memory-mapped)."""

    def __init__(self, path):
        import gguf

        self.path = path
        try:
            self.reader = gguf.GGUFReader(path)
        except Exception as e:  # the reader raises ValueError / struct errors on bad files
            raise ConvertError(f"{path}: not a readable GGUF file ({e})") from e
        self.tensors = {t.name: t for t in self.reader.tensors}

    def get(self, key, default=_REQUIRED):
        """The value of metadata `key` (strings decoded, arrays as lists); `default` if absent."""
        field = self.reader.fields.get(key)
        if field is None:
            if default is _REQUIRED:
                raise ConvertError(f"{self.path}: GGUF metadata key '{key}' is missing")
            return default
        return field.contents()

    def float32(self, key, default=_REQUIRED):
        """A float metadata value as the shortest decimal that is the same float32 (1e-05)."""
        v = self.get(key, default)
        if v is None or v is default:
            return v
        f = float(str(np.float32(v)))
        return int(f) if f.is_integer() else f

    def dequantized(self, name, shape):
        """Tensor `name` as a float32 numpy array of `shape` (rows, columns: numpy order, which
        is the reverse of GGUF's ne[] order), dequantized from any GGML type."""
        from gguf import quants

        t = self.tensors.get(name)
        if t is None:
            raise ConvertError(f"{self.path}: tensor '{name}' is missing")
        ne = tuple(int(d) for d in reversed(list(t.shape)))  # GGUF lists the fastest dim first
        if ne != tuple(shape):
            raise ConvertError(f"{self.path}: tensor '{name}' has shape {list(ne)}, the metadata "
                               f"implies {list(shape)}")
        try:
            w = quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise ConvertError(f"tensor '{name}': GGML type {t.tensor_type.name} cannot be "
                               f"dequantized by the gguf package ({e})") from e
        w = np.ascontiguousarray(np.asarray(w, dtype=np.float32).reshape(shape))
        if not np.isfinite(w).all():
            raise ConvertError(f"tensor '{name}' holds non-finite values")
        return w


def source_fingerprint(path):
    """Size, mtime and the sha256 of the first and last MiB of `path` (the cache key)."""
    st = os.stat(path)
    h = hashlib.sha256()
    mib = 1 << 20
    with open(path, "rb") as fh:
        h.update(fh.read(mib))
        if st.st_size > 2 * mib:
            fh.seek(st.st_size - mib)
        h.update(fh.read(mib))
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256_first_last_mib": h.hexdigest()}


# --- config -------------------------------------------------------------------------------------

def model_id(g, path):
    """The checkpoint's `lm_model_type` / `lm_tokenizer`: the Hugging Face repository the GGUF
    names, else `organization/Name` from general.organization and general.name, else
    general.basename, else the file name without its extension."""
    for key in ("general.source.huggingface.repository", "general.source.repo_url",
                "general.repo_url"):
        v = g.get(key, None)
        if isinstance(v, str) and v.strip():
            m = re.match(r"^(?:https?://)?huggingface\.co/([^/\s]+/[^/\s]+?)/?$", v.strip())
            if m:
                return m.group(1)
            if re.fullmatch(r"[\w.-]+/[\w.-]+", v.strip()):
                return v.strip()
    name = g.get("general.name", None)
    if isinstance(name, str) and name.strip():
        slug = lambda text: re.sub(r"[^\w.-]+", "-", text.strip()).strip("-")  # noqa: E731
        org = g.get("general.organization", None)
        if isinstance(org, str) and org.strip():
            return f"{slug(org)}/{slug(name)}"
        return slug(name)
    base = g.get("general.basename", None)
    if isinstance(base, str) and base.strip():
        return base.strip()
    return os.path.splitext(os.path.basename(path))[0]
