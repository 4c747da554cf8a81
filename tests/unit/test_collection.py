"""The README's test command must collect the multi-process proofs (tests/dist)."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_readme_test_command_collects_tests_dist():
    out = subprocess.run([sys.executable, "-m", "pytest", "tests", "--collect-only", "-q",
                          "-o", "addopts=", "-p", "no:cacheprovider"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    ids = [l for l in out.stdout.splitlines() if "::" in l]
    dist_ids = [i for i in ids if i.startswith("tests/dist/")]
    # the layout matrix at world 2/4/8 and expert parallelism at world 2/4 must be among them
    for name in ("test_world2_data_zero_expert_tensor_pipeline", "test_world4_composed_layouts",
                 "test_world8_all_five", "test_expert_parallel_world2", "test_expert_parallel_world4",
                 "test_replication_world2", "test_replication_world4"):
        assert any(i.endswith("::" + name) for i in dist_ids), (name, dist_ids)
