"""Attention backends on the command line (issue 26 item 7, issue 28): Megatron's --use-flash-attn
without flash-attn runs as SDPA with one start-up note; our explicit --attention-backend flash-attn
without the package and --attention-backend flex training on CPU end with one `error:` line, exit
1, no traceback. The three runs start together (one rank, tiny model, --mock-data)."""
import importlib.util

import pytest

from test_user_errors import TINY, assert_one_sentence, finish, start

pytestmark = pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None,
                                reason="flash-attn is installed: the fallback does not apply")


def test_missing_flash_attn_falls_back_for_megatron_and_is_refused_for_ours():
    runs = {"megatron": start(TINY + ["--train-iters", "1", "--use-flash-attn"]),
            "ours": start(TINY + ["--train-iters", "1", "--attention-backend", "flash-attn"]),
            "flex": start(TINY + ["--train-iters", "1", "--attention-backend", "flex",
                                  "--attention-dropout", "0"])}
    results = {name: finish(proc) for name, proc in runs.items()}
    rc, out, err = results["megatron"]
    assert rc == 0, (out[-2000:], err[-3000:])
    notes = [line for line in out.splitlines() if "--use-flash-attn" in line]
    assert notes == ["> --use-flash-attn runs as PyTorch's scaled_dot_product_attention (sdpa, "
                     "whose CUDA path has a flash kernel): flash-attn is not installed"], notes
    assert "> attention backend: sdpa" in out and "> attention: SDPA on CPU:" in out
    assert "Traceback" not in out + err
    assert_one_sentence(*results["ours"], "error: attention backend 'flash' (--attention-backend "
                                          "flash-attn) needs the flash-attn package")
    assert_one_sentence(*results["flex"], "error: --attention-backend flex cannot train on CPU: "
                                          "FlexAttention has no backward on CPU")
