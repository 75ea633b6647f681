"""`make gpu-check` (tools/gpu_check.py) where there is no GPU: the preflight names the missing
GPU in one line, the CPU half of the training comparison runs through `caffe-syncbn train`,
the report is written into one flat folder, and the exit status says that something was
missing. The loss parser and the comparison are checked on the log of that run, and
benchmarks/efficiency.py against the calculation of docs/training.md."""
import math
import re
import sys

import pytest
import watchdog

from caffe_syncbn.backend import gpu_count
from conftest import ROOT

sys.path.insert(0, str(ROOT / 'tools'))
sys.path.insert(0, str(ROOT / 'benchmarks'))

from efficiency import step_on_many  # noqa: E402
from gpu_check_training import ITERATIONS, TOLERANCE, compare_losses, losses  # noqa: E402

MB = 1e6


@pytest.fixture(scope='module')
def cpu_run(tmp_path_factory):
    out = tmp_path_factory.mktemp('report')
    result = watchdog.run([sys.executable, str(ROOT / 'tools' / 'gpu_check.py'), '--only',
                           'preflight,train-reference', '--out', str(out)],
                          capture_output=True, text=True, limit=300)
    return result, out


def test_the_report_is_written_and_the_reference_trains(cpu_run):
    result, out = cpu_run
    assert sorted(p.name for p in out.iterdir()) == ['report.md', 'train-reference.log'], \
        result.stdout[-3000:] + result.stderr[-3000:]
    report = (out / 'report.md').read_text()
    for heading in ('# make gpu-check', '## Preflight', '## Steps', '### train-reference'):
        assert re.search('^%s$' % re.escape(heading), report, re.M), report
    rows = re.findall(r'^\| ([\w-]+) \| (\w+) \| \d+ \| ([\w.-]+) \|', report, re.M)
    assert rows == [('train-reference', 'passed', 'train-reference.log')], report
    assert re.search(r'^\| commit \| \S', report, re.M), report
    assert re.search(r'^`\S*python\S* -m caffe_syncbn train .*-sync_bn -cpu_devices 2`$', report,
                     re.M), report
    assert 'Iteration %d, loss = ' % ITERATIONS in report


@pytest.mark.skipif(gpu_count() > 0, reason='this machine has a GPU: nothing to name missing')
def test_the_missing_gpu_is_one_line_and_fails_the_run(cpu_run):
    result, out = cpu_run
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    report = (out / 'report.md').read_text()
    gpu_lines = [line for line in report.splitlines() if line.startswith('- missing: gpu:')]
    assert len(gpu_lines) == 1, report
    assert 'every GPU step is skipped' in gpu_lines[0]
    assert re.search(r'^\| GPU \| none \|$', report, re.M), report
    assert result.stdout.count('missing: gpu:') == 1, result.stdout


def test_the_loss_parser_reads_a_real_training_log(cpu_run):
    _, out = cpu_run
    text = (out / 'train-reference.log').read_text()
    parsed = losses(text)
    assert sorted(parsed) == list(range(ITERATIONS + 1))
    # every iteration also prints "Train net output #0: loss = ...": those are not losses here
    assert text.count('loss = ') > len(parsed)
    for iteration, value in re.findall(r'\] Iteration (\d+), loss = (\S+)$', text, re.M):
        assert parsed[int(iteration)] == float(value)
    assert all(math.isfinite(v) and v > 0 for v in parsed.values())


def test_the_comparison_allows_rounding_and_catches_more(cpu_run):
    _, out = cpu_run
    reference = losses((out / 'train-reference.log').read_text())
    passed, note, rows = compare_losses(reference, dict(reference))
    assert passed and len(rows) == ITERATIONS + 1 and max(r[3] for r in rows) == 0, note
    for iteration, limit in ((0, TOLERANCE['first']), (ITERATIONS, TOLERANCE['any'])):
        for factor, expected in ((0.5, True), (2.0, False)):
            moved = dict(reference)
            moved[iteration] *= 1 + factor * limit
            passed, note, rows = compare_losses(reference, moved)
            assert passed == expected, note
            assert 'at iteration %d' % iteration in note
    short = {k: v for k, v in reference.items() if k != 7}
    passed, note, _ = compare_losses(reference, short)
    assert not passed and 'not 0..%d' % ITERATIONS in note


def test_unknown_step_is_one_error_line(tmp_path):
    result = watchdog.run([sys.executable, str(ROOT / 'tools' / 'gpu_check.py'), '--only',
                           'train-refrence', '--out', str(tmp_path)],
                          capture_output=True, text=True, limit=60)
    assert result.returncode == 2
    assert "unknown step 'train-refrence'" in result.stderr.strip().splitlines()[-1]


def test_efficiency_is_the_calculation_of_docs_training():
    # docs/training.md: T = 1.0 s, 100 batch norms, 260 MB of gradients, buckets of 25 MB,
    # 15 us and 150 GB/s within a node, 40 us and 12 GB/s across two
    one_node, added = step_on_many(1.0, 100, 260 * MB, 15e-6, 150e9, 25 * MB)
    assert one_node == pytest.approx(1.0 + 201 * 15e-6 + 2 * 25 * MB / 150e9, rel=1e-12)
    assert added['unhidden gradients'] == 0
    two_nodes, _ = step_on_many(1.0, 100, 260 * MB, 40e-6, 12e9, 25 * MB)
    assert two_nodes == pytest.approx(1.0 + 201 * 40e-6 + 2 * 25 * MB / 12e9, rel=1e-12)
    assert one_node / two_nodes == pytest.approx(0.99, abs=0.005)
    # a 10 Gb/s link and T = 0.25 s: 430 ms of gradients no longer hide in the backward
    slow, added = step_on_many(0.25, 100, 260 * MB, 40e-6, 1.2e9, 25 * MB)
    assert added['unhidden gradients'] == pytest.approx(2 * 260 * MB / 1.2e9 - 0.65 * 0.25)
    assert 0.40 < 0.25 / slow < 0.50
