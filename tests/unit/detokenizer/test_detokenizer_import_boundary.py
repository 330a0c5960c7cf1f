"""The detokenizer never imports torch (nor transformers): its modules import, and it loads and
decodes the real tokenizer, in a process where importing torch fails."""

from __future__ import annotations

import subprocess
import sys

CODE = """
import sys
sys.modules["torch"] = None
sys.modules["transformers"] = None
import meshlm.detokenizer.__main__
import meshlm.detokenizer.service
from meshlm.detokenizer.decoder import TokenizerDecoder
from meshlm.detokenizer.incremental import IncrementalDetokenizer, Seed, TokenDelta
d = TokenizerDecoder.from_path(sys.argv[1])
ids = d.tokenizer.encode("no torch here", add_special_tokens=False).ids
[r] = IncrementalDetokenizer(d).step([TokenDelta("r", ids, 0, Seed(), finished=True)])
assert r.text == "no torch here", r
loaded = [m for m in sys.modules if m.split(".")[0] in ("torch", "transformers") and sys.modules[m] is not None]
assert not loaded, loaded
print("ok")
"""


def test_detokenizer_imports_without_torch(smollm_path: str) -> None:
    proc = subprocess.run([sys.executable, "-c", CODE, smollm_path], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"
