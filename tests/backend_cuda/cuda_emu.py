"""The CUDA kernels on the CPU: their sources built with g++ against tests/backend_cuda/emu.

``build(out_dir)`` compiles decode.cu, prefill.cu and rotary.cu unchanged, with the
emulator's CUDA headers and its ``ptx.cuh`` (cp.async, ldmatrix and mma semantics over the
fibers of a warp) in place of the real one; ``Emulator`` calls the launchers of kernels.h
with CPU tensors, in the signatures of ``astrai.extension.ops``.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

import torch

from astrai_backend_cuda import _sources

EMU = Path(__file__).parent / "emu"
_DTYPES = {torch.bfloat16: 0, torch.float16: 1}
_CTYPES = {"i": ctypes.c_int, "l": ctypes.c_int64, "p": ctypes.c_void_p, "f": ctypes.c_float}


def _argtypes(codes: str) -> list:
    return [_CTYPES[c] for c in codes]


def build(out_dir: Path) -> Path:
    """Compile the emulated kernels into ``out_dir/libastrai_emu.so``; raises CalledProcessError with g++'s
    output."""
    for src in _sources.CSRC.iterdir():
        if src.name != "ptx.cuh":
            shutil.copy(src, out_dir / src.name)
    shutil.copy(EMU / "ptx.cuh", out_dir / "ptx.cuh")
    lib = out_dir / "libastrai_emu.so"
    cmd = [
        os.environ.get("CXX", "g++"),
        "-std=c++20",
        "-O1",
        "-fPIC",
        "-shared",
        "-fno-strict-aliasing",
        "-Wall",
        "-Wextra",
        "-Wno-unknown-pragmas",
        "-Werror",
        f"-I{EMU / 'include'}",
        f"-I{out_dir}",
        "-include",
        str(EMU / "emu.h"),
        "-x",
        "c++",
        *(str(out_dir / k) for k in _sources.KERNELS),
        "-x",
        "none",
        str(EMU / "emu.cpp"),
        str(EMU / "capi.cpp"),
        "-o",
        str(lib),
    ]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return lib


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def _layer(scales: torch.Tensor | None, layer_id: int) -> int | None:
    """The pointer to layer ``layer_id`` of an int8 pool's ``[n_layers, size, Hkv]`` scales, or NULL."""
    return None if scales is None else scales[layer_id].data_ptr()


class Emulator:
    """The three ops on CPU tensors (same arguments and writes as ``astrai.extension.ops``)."""

    def __init__(self, lib_path: Path) -> None:
        self.lib = ctypes.CDLL(str(lib_path))
        # argument types, one letter each: i int, l int64, p pointer, f float (see emu/capi.cpp)
        self.lib.emu_paged_decode.argtypes = _argtypes("ipllpllpllppplppppppiiiiiiififpp")
        self.lib.emu_paged_prefill.argtypes = _argtypes("ipllppplpppppplliiiififpp")
        self.lib.emu_rotary.argtypes = _argtypes("ipllppllliii")
        self.lib.emu_last_error.restype = ctypes.c_char_p

    def _check(self, err: int, op: str) -> None:
        if err:
            raise RuntimeError(f"{op}: cudaError {err}: {self.lib.emu_last_error().decode()}")

    def attn_paged_decode(
        self,
        q,
        new_k,
        new_v,
        k_buffer,
        v_buffer,
        layer_id,
        req_to_token,
        req_pool_indices,
        seq_lens,
        out_cache_loc,
        max_len,
        num_splits,
        o_part,
        ml_part,
        out,
        scale,
        window=0,
        softcap=0.0,
        k_scale=None,
        v_scale=None,
    ):
        k, v = k_buffer[layer_id], v_buffer[layer_id]
        err = self.lib.emu_paged_decode(
            _DTYPES[q.dtype],
            _ptr(q),
            q.stride(0),
            q.stride(1),
            _ptr(new_k),
            new_k.stride(0),
            new_k.stride(1),
            _ptr(new_v),
            new_v.stride(0),
            new_v.stride(1),
            _ptr(k),
            _ptr(v),
            _ptr(req_to_token),
            req_to_token.stride(0),
            _ptr(req_pool_indices),
            _ptr(seq_lens),
            _ptr(out_cache_loc),
            _ptr(o_part),
            _ptr(ml_part),
            _ptr(out),
            q.shape[0],
            q.shape[1],
            k.shape[1],
            q.shape[2],
            max_len,
            num_splits,
            o_part.shape[2],
            scale,
            window,
            softcap,
            _layer(k_scale, layer_id),
            _layer(v_scale, layer_id),
        )
        self._check(err, "attn_paged_decode")
        return out

    def attn_paged_prefill(
        self,
        q,
        k_buffer,
        v_buffer,
        layer_id,
        req_to_token,
        req_pool_indices,
        qo_indptr,
        kv_indptr,
        q_tile_to_batch,
        q_tile_to_index,
        scale,
        out=None,
        window=0,
        softcap=0.0,
        k_scale=None,
        v_scale=None,
    ):
        out = torch.empty_like(q) if out is None else out
        k, v = k_buffer[layer_id], v_buffer[layer_id]
        err = self.lib.emu_paged_prefill(
            _DTYPES[q.dtype],
            _ptr(q),
            q.stride(0),
            q.stride(1),
            _ptr(k),
            _ptr(v),
            _ptr(req_to_token),
            req_to_token.stride(0),
            _ptr(req_pool_indices),
            _ptr(qo_indptr),
            _ptr(kv_indptr),
            _ptr(q_tile_to_batch),
            _ptr(q_tile_to_index),
            _ptr(out),
            out.stride(0),
            out.stride(1),
            q_tile_to_batch.shape[0],
            q.shape[1],
            k.shape[1],
            q.shape[2],
            scale,
            window,
            softcap,
            _layer(k_scale, layer_id),
            _layer(v_scale, layer_id),
        )
        self._check(err, "attn_paged_prefill")
        return out

    def rotary_emb(self, x, freqs, out=None):
        out = torch.empty_like(x) if out is None else out
        x3, out3 = x.reshape(-1, *x.shape[-2:]), out.view(-1, *out.shape[-2:])

        def aligned(t):
            return t.data_ptr() % 16 == 0 and t.stride(0) % 8 == 0 and t.stride(1) % 8 == 0

        vec16 = x.shape[-1] % 8 == 0 and aligned(x3) and aligned(out3) and freqs.data_ptr() % 16 == 0
        err = self.lib.emu_rotary(
            _DTYPES[x.dtype],
            _ptr(x3),
            x3.stride(0),
            x3.stride(1),
            _ptr(freqs),
            _ptr(out3),
            out3.stride(0),
            out3.stride(1),
            x3.shape[0],
            x3.shape[1],
            x3.shape[2],
            int(vec16),
        )
        self._check(err, "rotary_emb")
        return out
