"""``astrai serve --weights gguf`` and the default ``--weights auto`` in bf16: the default model served on its
quantized blocks, through the OpenAI SDK."""

from __future__ import annotations

import subprocess
import sys

import openai
import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cpu._is_avx512_bf16_supported(), reason="the quantized kernels need AVX512-BF16"
)


def test_chat_and_a_stream_on_quantized_weights_by_default_in_bfloat16(start_server):
    """The default ``--weights auto`` in bf16 serves on the quantized blocks (``--weights gguf`` in
    float32 is the oracle tests' model, tests/integration/test_oracle.py)."""
    served = start_server("--dtype", "bfloat16", "--max-seq-len", "1024")  # no --weights: the default
    assert "quantized linears" in served.log()  # the load line names them: 90 layer projections and the head
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    reply = client.chat.completions.create(model="astrai", messages=messages, temperature=0, max_tokens=12)
    assert "Paris" in reply.choices[0].message.content
    chunks = list(
        client.chat.completions.create(
            model="astrai", messages=messages, temperature=0, max_tokens=12, stream=True
        )
    )
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        == reply.choices[0].message.content
    )
    served.wait_idle()


def test_weights_gguf_with_tensor_parallelism_exits_2_at_start():
    proc = subprocess.run(
        [sys.executable, "-m", "astrai.cli", "serve", "--weights", "gguf", "--tensor-parallel-size", "3"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "--weights gguf needs --tensor-parallel-size 1" in proc.stderr
