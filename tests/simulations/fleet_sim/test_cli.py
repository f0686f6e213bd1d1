"""`kvplane sim` from the command line: a table, and the JSON the issue names; and the
errors of `kvplane sim` and `kvplane bench policies`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvplane.cli import main
from simulations.fleet_sim.policies import POLICIES

TRACE = Path(__file__).resolve().parents[3] / "simulations" / "traces" / "mooncake"
MODELS = Path(__file__).resolve().parents[3] / "simulations" / "models"
FIELDS = {
    "hit_rate", "pooled_fraction", "ceiling_fraction", "prefill_tokens_saved", "ttft_mean_s",
    "ttft_p50_s",
    "ttft_p90_s", "ttft_p99_s", "e2e_p99_s", "output_tokens_per_s", "load_imbalance",
    "preemptions", "engine_hit_rate",
}  # fmt: skip


def test_a_generated_workload_gives_a_table_and_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "sim.json"
    code = main(
        ["sim", "--workload", "shared-prefix", "--workload-arg", "groups=4",
         "--workload-arg", "prompts_per_group=6", "--workload-arg", "rate_per_s=5",
         "--workers", "2", "--capacity-tokens", "65536", "--json", str(out)]
    )  # fmt: skip
    assert code == 0
    table = capsys.readouterr().out
    for policy in ("random", "round-robin", "least-loaded", "kvplane", "(pooled)", "(infinite)"):
        assert policy in table
    document = json.loads(out.read_text())
    assert set(document["policies"]) == set(POLICIES)
    for figures in document["policies"].values():
        assert set(figures) >= FIELDS
        assert 0 <= figures["hit_rate"] <= 1
    assert document["run"]["workers"] == 2
    assert 0 < document["bounds"]["pooled"] <= document["bounds"]["infinite"] <= 1


def test_plots_are_written_as_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        ["sim", "--workload", "shared-prefix", "--workload-arg", "groups=2",
         "--workload-arg", "prompts_per_group=4", "--workers", "2",
         "--policies", "kvplane,random", "--plot", str(tmp_path / "plots")]
    )  # fmt: skip
    assert code == 0
    names = sorted(path.name for path in (tmp_path / "plots").iterdir())
    assert names == ["hit_rate.png", "load_kvplane.png", "load_random.png", "ttft.png"]
    for path in (tmp_path / "plots").iterdir():
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_trace_replays_with_a_limit(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        ["sim", "--trace", str(TRACE / "conversation_trace.jsonl"), "--limit", "300",
         "--policies", "kvplane,round-robin", "--workers", "4"]
    )  # fmt: skip
    assert code == 0
    assert "300 requests" in capsys.readouterr().out


def test_a_model_and_gpu_time_the_steps(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    runs = {}
    for gpus in ("1", "2"):
        out = tmp_path / f"tp{gpus}.json"
        code = main(
            ["sim", "--workload", "shared-prefix", "--workload-arg", "groups=3",
             "--workload-arg", "prompts_per_group=4", "--workers", "2", "--policies", "kvplane",
             "--model-config", str(MODELS / "qwen3-32b.json"), "--gpu", "h100",
             "--tensor-parallel", gpus, "--json", str(out)]
        )  # fmt: skip
        assert code == 0
        runs[gpus] = json.loads(out.read_text())
    timing = runs["1"]["run"]["timing"]
    assert timing["decode_ms_per_request"] > 0
    assert runs["2"]["run"]["timing"]["prefill_ms_per_token"] == timing["prefill_ms_per_token"] / 2
    # Twice the GPUs per worker: the same requests finish sooner.
    faster = runs["2"]["policies"]["kvplane"]
    assert faster["e2e_p99_s"] < runs["1"]["policies"]["kvplane"]["e2e_p99_s"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["sim"], "give --trace FILE, --workload NAME or --live NAME"),
        (["sim", "--workload", "nope"], "unknown workload"),
        (["sim", "--live", "agent-trees"], "unknown live workload"),
        (["sim", "--live", "shared-2", "--time-scale", "0"], "--time-scale must be positive"),
        (
            ["sim", "--live", "shared-2", "--router-overhead-ms", "magic=3"],
            "unknown policies",
        ),
        (["sim", "--workload", "shared-prefix", "--policies", "magic"], "unknown policies"),
        (["sim", "--workload", "shared-prefix", "--workload-arg", "colours=3"], "colours"),
        (
            ["sim", "--workload", "shared-prefix", "--model-config", "/nonexistent.json"],
            "cannot read the model config",
        ),
        (
            [
                "sim",
                "--workload",
                "shared-prefix",
                "--model-config",
                str(MODELS / "llama3-8b.json"),
                "--gpu",
                "tpu",
            ],
            "unknown GPU",
        ),
        (["bench", "policies", "--scoring", "queue_weight=2"], "queue_weight"),
        (["bench", "policies", "--scoring", "queued_prefill_weight=-1"], "greater than"),
        (["bench", "policies", "--only", "chess"], "no workload called chess"),
    ],
)
def test_bad_arguments_are_one_clear_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    error = capsys.readouterr().err
    assert message in error
    assert "Traceback" not in error


def test_a_sweep_says_which_fleet_sizes_meet_the_slo(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "sweep.json"
    code = main(
        ["sim", "--workload", "shared-prefix", "--workload-arg", "groups=4",
         "--workload-arg", "prompts_per_group=6", "--workload-arg", "rate_per_s=20",
         "--policies", "kvplane,round-robin", "--capacity-tokens", "65536",
         "--sweep", "workers=1,4", "--slo-ttft-p90", "0.5", "--json", str(out)]
    )  # fmt: skip
    assert code == 0
    text = capsys.readouterr().out
    assert "sweeping workers over 1, 4" in text
    assert "kvplane: meets it at" in text
    sweep = json.loads(out.read_text())["sweep"]
    assert sweep["setting"] == "workers"
    assert [point["value"] for point in sweep["points"]] == [1, 4]
    one, four = (point["policies"]["kvplane"]["ttft_p90_s"] for point in sweep["points"])
    assert four < one  # more workers, less queueing


def test_a_live_shape_runs_on_the_live_fleet_with_router_overheads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = {}
    for name, overhead in (("free", []), ("charged", ["--router-overhead-ms", "round-robin=30"])):
        out = tmp_path / f"{name}.json"
        code = main(
            ["sim", "--live", "shared-4", "--workload-arg", "rate_per_s=5",
             "--workload-arg", "duration_s=4", "--policies", "kvplane,round-robin",
             *overhead, "--json", str(out)]
        )  # fmt: skip
        assert code == 0
        runs[name] = json.loads(out.read_text())
    assert "live/shared-4" in capsys.readouterr().out
    run = runs["charged"]["run"]
    assert (run["workers"], run["capacity_tokens"], run["block_tokens"]) == (4, 8192, 16)
    assert run["limits"]["max_num_seqs"] == 16
    assert run["router_overhead_s"] == {"round-robin": 0.03}
    free, charged = runs["free"]["policies"], runs["charged"]["policies"]
    assert charged["kvplane"] == free["kvplane"]
    assert charged["round-robin"]["ttft_p50_s"] == pytest.approx(
        free["round-robin"]["ttft_p50_s"] + 0.03, abs=0.005
    )
    # Explicit fleet flags still win over the live fleet's.
    code = main(
        ["sim", "--live", "shared-4", "--workload-arg", "rate_per_s=5", "--workload-arg",
         "duration_s=2", "--policies", "round-robin", "--workers", "2", "--max-num-seqs", "4",
         "--json", str(tmp_path / "two.json")]
    )  # fmt: skip
    assert code == 0
    run = json.loads((tmp_path / "two.json").read_text())["run"]
    assert (run["workers"], run["limits"]["max_num_seqs"]) == (2, 4)


def test_a_malformed_router_overhead_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["sim", "--live", "shared-2", "--router-overhead-ms", "kvplane=-3"])
    assert "POLICY=MILLISECONDS" in capsys.readouterr().err


def test_a_time_scale_slows_every_step(tmp_path: Path) -> None:
    runs = {}
    for scale in ("1", "2"):
        out = tmp_path / f"x{scale}.json"
        code = main(
            ["sim", "--live", "shared-2", "--workload-arg", "rate_per_s=2", "--workload-arg",
             "duration_s=3", "--policies", "round-robin", "--time-scale", scale,
             "--json", str(out)]
        )  # fmt: skip
        assert code == 0
        runs[scale] = json.loads(out.read_text())
    one, two = runs["1"]["run"]["timing"], runs["2"]["run"]["timing"]
    assert two == {key: 2 * value for key, value in one.items()}
    fast, slow = (runs[s]["policies"]["round-robin"] for s in ("1", "2"))
    assert slow["ttft_p90_s"] == pytest.approx(2 * fast["ttft_p90_s"], rel=0.05)


def test_the_live_router_overheads_are_a_preset_flags_override(tmp_path: Path) -> None:
    out = tmp_path / "live.json"
    code = main(
        ["sim", "--live", "shared-2", "--workload-arg", "rate_per_s=2", "--workload-arg",
         "duration_s=2", "--policies", "kvplane", "--live-router-overheads",
         "--router-overhead-ms", "kvplane=40", "--json", str(out)]
    )  # fmt: skip
    assert code == 0
    overheads = json.loads(out.read_text())["run"]["router_overhead_s"]
    assert overheads == {
        "kvplane": 0.04, "round-robin": 0.025, "sglang-cache-aware": 0.005,
        "vllm-router-cache-aware": 0.005,
    }  # fmt: skip


def test_scoring_weights_change_kvplanes_policies_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    figures = {}
    for name, weights in (
        ("default", []),
        (
            "queue-shy",
            ["--scoring", "waiting_request_tokens=1e6", "--scoring", "running_request_tokens=1e6"],
        ),
    ):
        out = tmp_path / f"{name}.json"
        code = main(
            ["sim", "--live", "shared-2", "--workload-arg", "rate_per_s=10", "--workload-arg",
             "duration_s=4", "--policies", "kvplane,round-robin", *weights, "--json", str(out)]
        )  # fmt: skip
        assert code == 0
        figures[name] = json.loads(out.read_text())["policies"]
    # Queue terms that dwarf any cached prefix spread the two prompts over every worker.
    assert figures["queue-shy"]["kvplane"]["hit_rate"] < figures["default"]["kvplane"]["hit_rate"]
    assert figures["queue-shy"]["round-robin"] == figures["default"]["round-robin"]
    capsys.readouterr()
    assert main(["sim", "--live", "shared-2", "--scoring", "no_such_weight=1"]) == 2
    assert "no_such_weight" in capsys.readouterr().err
