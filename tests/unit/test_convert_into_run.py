"""tools/checkpoint/convert.py never writes into a training run's --save folder (docs/design.md §12:
bad input loses nothing): a converted checkpoint would rewrite the tracker to 'release', and the
run's next resume would load the converted weights and save over its own iterations. The run lock
(<save>/.megatron_sp.lock) covers conversions: a conversion into a folder a run holds is refused,
and a run cannot start into a folder a conversion is writing."""
from __future__ import annotations

import hashlib
import os
import sys

import pytest

from megatron_sp.checkpointing.lock import LOCK_FILENAME, SaveLock, SaveLockError
from megatron_sp.testing import load_script

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
convert = load_script("tools/checkpoint/convert.py")

FLAGS = ("--mock-data --vocab-size 300 --num-layers 2 --hidden-size 64 --num-attention-heads 4 "
         "--num-query-groups 2 --ffn-hidden-size 96 --swiglu --position-embedding-type rope "
         "--rotary-base 5000 --normalization RMSNorm --disable-bias-linear "
         "--untie-embeddings-and-output-weights --max-position-embeddings 64 --seq-length 16 "
         "--micro-batch-size 2 --global-batch-size 2 --eval-iters 0 --attention-backend sdpa "
         "--log-interval 1 --save-interval 1 --lr 1e-3 --lr-decay-iters 10").split()


def _checksums(folder) -> dict[str, str]:
    """{relative path: sha256} of every file under `folder`."""
    sums = {}
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                sums[os.path.relpath(path, folder)] = hashlib.sha256(f.read()).hexdigest()
    return sums


def _refusal(argv) -> str:
    with pytest.raises(SystemExit) as info:
        convert.main(argv)
    message = str(info.value.code)
    assert message.startswith("error: ") and message.endswith(".") and "\n" not in message
    return message


def test_train_export_convert_back_into_the_run_is_refused_and_the_run_resumes(tmp_path):
    sys.path.insert(0, ROOT)
    import pretrain_gpt
    run, hf = str(tmp_path / "run"), str(tmp_path / "hf")
    pretrain_gpt.main(FLAGS + ["--train-iters", "2", "--save", run])
    assert (tmp_path / "run" / "latest_checkpointed_iteration.txt").read_text() == "2"
    convert.main(["--loader", "megatron_sp", "--saver", "hf", "--load-dir", run, "--save-dir", hf])
    before = _checksums(run)
    assert "iter_0000002/metadata.json" in before or any(k.startswith("iter_0000002/")
                                                         for k in before)

    # The natural mistake: the imported weights "where my run is". Every saver is refused.
    for saver, loader, load in (("megatron_sp", "hf", hf), ("hf", "megatron_sp", run),
                                ("safetensors", "megatron_sp", run)):
        message = _refusal(["--loader", loader, "--saver", saver, "--load-dir", load,
                            "--save-dir", run])
        assert message == (
            f"error: --save-dir {run} holds a training run's checkpoints (tracker "
            f"latest_checkpointed_iteration.txt names iteration 2) and a conversion never writes "
            f"into a run's folder (the run's next resume would load the converted weights and "
            f"save over its own iterations): choose a new or empty --save-dir, e.g. "
            f"{run}-converted."), message
        assert _checksums(run) == before, saver          # nothing written, no lock file left

    # Iterations without a tracker (a run killed before its first publish, a tracker deleted).
    os.rename(os.path.join(run, "latest_checkpointed_iteration.txt"), tmp_path / "tracker")
    assert "it holds iter_0000002" in _refusal(["--loader", "hf", "--saver", "megatron_sp",
                                                "--load-dir", hf, "--save-dir", run])
    os.rename(tmp_path / "tracker", os.path.join(run, "latest_checkpointed_iteration.txt"))
    assert _checksums(run) == before

    # The run resumes from its own iteration 2 (not the converted weights at iteration 0), and
    # iteration 2's files are the ones it saved.
    pretrain_gpt.main(FLAGS + ["--train-iters", "3", "--save", run, "--load", run])
    assert (tmp_path / "run" / "latest_checkpointed_iteration.txt").read_text() == "3"
    after = _checksums(run)
    assert {k: v for k, v in after.items() if k.startswith("iter_0000002/")} == \
        {k: v for k, v in before.items() if k.startswith("iter_0000002/")}

    # Where nothing is lost: a new folder, and converting again over a converted checkpoint.
    converted = str(tmp_path / "run-converted")
    for _ in range(2):
        convert.main(["--loader", "hf", "--saver", "megatron_sp", "--load-dir", hf,
                      "--save-dir", converted])
        assert (tmp_path / "run-converted" / "latest_checkpointed_iteration.txt").read_text() \
            == "release"
        assert not (tmp_path / "run-converted" / LOCK_FILENAME).exists()


def test_the_run_lock_covers_conversions(tmp_path):
    """A folder a run (here: a lock this test holds, as pretrain_gpt's rank 0 does) is saving into
    is refused naming the holder; a run cannot take the lock while a conversion holds it."""
    out = str(tmp_path / "out")
    held = SaveLock(out)
    held.acquire()
    try:
        message = _refusal(["--loader", "megatron_sp", "--saver", "safetensors",
                            "--load-dir", str(tmp_path / "none"), "--save-dir", out])
        assert message.startswith(f"error: --save-dir {out} is locked by another run (host "), \
            message
        assert message.endswith("wait for that run to end or choose another --save-dir."), message
        assert not os.path.exists(os.path.join(out, "model.safetensors"))
    finally:
        held.release()

    from megatron_sp.checkpointing.lock import conversion_target
    with conversion_target(out):
        with pytest.raises(SaveLockError, match=f"--save {out} is locked by another run"):
            SaveLock(out).acquire()
    assert not os.path.exists(os.path.join(out, LOCK_FILENAME))


def test_an_output_that_cannot_be_a_folder_is_one_sentence(tmp_path):
    (tmp_path / "afile").write_text("x")
    args = ["--loader", "megatron_sp", "--saver", "safetensors", "--load-dir", str(tmp_path)]
    assert _refusal(args + ["--save-dir", str(tmp_path / "afile")]) == (
        f"error: --save-dir {tmp_path / 'afile'} is a file, not a folder: choose a folder (new or "
        f"empty) for the output.")
    assert (tmp_path / "afile").read_text() == "x"
    inside = str(tmp_path / "afile" / "out")        # a file where a parent folder should be
    assert _refusal(args + ["--save-dir", inside]) == (
        f"error: cannot write into --save-dir {inside} (Not a directory): choose a folder you can "
        f"write to.")
