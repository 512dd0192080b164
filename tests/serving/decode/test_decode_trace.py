"""What one greedy EAGLE-3 decode step crosses (bench/tools/decode_trace.py, issue 25): the tool
traces one BatchEngine.step, and the step stays within the functions and files it crossed
when the decode room was last tidied. A new helper on the step's path fails here: fold it
into an existing one, or raise the bound and say why in the commit."""

from __future__ import annotations

import pytest

from specheads.bench.tools.decode_trace import StepTrace, format_report, tiny_eagle3_decoder, trace_one_step

# 54 before issue 25, 45 after it; 57 and 11 since the step accepts on the device for the whole
# batch (serving/decode/accept.py) from one batched draft object (serving/decode/draft_batch.py),
# and the EAGLE head drafts every row at once into its own KV cache (eagle.py HeadKV); 38 and 10
# since issue 46 made the step one device function (serving/decode/steps.py DeviceStep) with one
# drafter protocol and one fault boundary. Of those, the serving code's own (the models' code in
# heads/ aside: the EAGLE-3 head's 7 functions and the target adapter's forward) is 30 in 8 files.
MAX_FUNCTIONS = 38
MAX_FILES = 10
MAX_SERVING_FUNCTIONS = 30
MAX_SERVING_FILES = 8


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    return tiny_eagle3_decoder(tmp_path_factory.mktemp("decode-trace"), dynamic=False)


def test_one_greedy_eagle3_step_stays_within_its_crossing_budget(decoder):
    report = trace_one_step(decoder, warmup_steps=2)
    functions = report["functions"]
    assert "BatchEngine.step" in functions["serving/decode/engine.py"]
    assert "accept" in functions["serving/decode/accept.py"]  # the greedy accept test's one owner
    assert "StaticEagleDrafter.draft" in functions["serving/decode/eagle.py"]
    assert report["num_functions"] <= MAX_FUNCTIONS and report["num_files"] <= MAX_FILES, format_report(report)
    serving = {path: names for path, names in functions.items() if path.startswith("serving/")}
    assert sum(map(len, serving.values())) <= MAX_SERVING_FUNCTIONS and len(serving) <= MAX_SERVING_FILES, \
        format_report(report)


def test_the_trace_sees_only_what_runs_inside_it():
    def outside():
        return 1

    with StepTrace() as trace:
        outside()
    assert trace.report()["num_functions"] == 0  # this test's file is not under a part
    from specheads.serving.decode.stats import alpha_tau

    with StepTrace() as trace:
        alpha_tau(1, 2, 1)
    assert trace.report()["functions"] == {"serving/decode/stats.py": ["alpha_tau"]}
