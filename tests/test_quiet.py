"""des.quiet: TensorFlow's and TFRA's start-up noise stays off stderr, anything else printed
while they load still shows, and the commands' --help print nothing on stderr."""
import importlib.machinery
import importlib.util
import os
import subprocess
import sys

import pytest

from des.quiet import NOISE, _QuietLoader

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_loader_drops_the_known_noise_and_keeps_the_rest(tmp_path, capfd):
    """A module that writes, to file descriptor 2 as a C++ library would, one known start-up line,
    one line of its own and a Python warning: only the first is dropped."""
    path = tmp_path / "noisy_module.py"
    path.write_text("import os, sys\n"
                    f"os.write(2, b'2026-01-01 E cuda_dnn.cc] {NOISE[0]}: already registered\\n')\n"
                    "os.write(2, b'E real_problem.cc] could not open /dev/thing\\n')\n"
                    "print('WARNING: something the user must see', file=sys.stderr)\n")
    loader = importlib.machinery.SourceFileLoader("noisy_module", str(path))
    spec = importlib.util.spec_from_loader("noisy_module", _QuietLoader(loader))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    err = capfd.readouterr().err
    assert NOISE[0] not in err
    assert "could not open /dev/thing" in err and "something the user must see" in err


def test_an_error_while_loading_still_shows_and_raises(tmp_path, capfd):
    path = tmp_path / "broken_module.py"
    path.write_text("import os\nos.write(2, b'loading went wrong\\n')\nraise ImportError('broken')\n")
    loader = importlib.machinery.SourceFileLoader("broken_module", str(path))
    spec = importlib.util.spec_from_loader("broken_module", _QuietLoader(loader))
    with pytest.raises(ImportError, match="broken"):
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
    assert "loading went wrong" in capfd.readouterr().err


@pytest.mark.parametrize("command", ["des.train", "des.data.synth", "des.predict", "des.export", "des.compare",
                                     "des.data.convert", "des.netbed"])
def test_help_prints_nothing_on_stderr(command):
    done = subprocess.run([sys.executable, "-m", command, "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.startswith("usage:")
    assert done.stderr == ""
