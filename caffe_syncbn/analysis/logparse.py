"""Caffe training logs as tables: parse the solver's lines, write CSV files and a plot.

Reads the lines that BVLC Caffe's solver prints (through glog) and that this package's
solver prints in the same words, with or without the glog prefix:

    I0312 10:00:00.123456  4242 solver.cpp:218] Iteration 100 (9.3 iter/s, 10.7s/100 iters), loss = 0.42
    I0312 10:00:00.123456  4242 sgd_solver.cpp:105] Iteration 100, lr = 0.01
    I0312 10:00:01.000000  4242 solver.cpp:330] Iteration 500, Testing net (#0)
    I0312 10:00:01.500000  4242 solver.cpp:397]     Test net output #0: accuracy = 0.98
    I0312 10:00:01.500000  4242 solver.cpp:397]     Test net output #1: loss = 0.05 (* 1 = 0.05 loss)

Train rows are {'iteration', 'loss', 'lr'}; the loss and the lr line of one iteration make
one row. Test rows are {'iteration', <output name>: value, ...}, one per test pass. An
output that appears twice in one pass (a vector output, printed once per element) gets
``name_1``, ``name_2``... for its later elements; outputs of test net #k > 0 are
prefixed ``net<k>_``. A resumed run that repeats iterations keeps every row, in order.
"""
import csv
import io
import os
import re

from ..errors import CaffeError
from ..formats.atomic import atomic_write

_NUMBER = r'([-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?|nan|inf|infinity))'
TRAIN_LOSS = re.compile(r'Iteration (\d+)(?: \([^)]*\))?, loss = ' + _NUMBER, re.IGNORECASE)
LEARNING_RATE = re.compile(r'Iteration (\d+), lr = ' + _NUMBER, re.IGNORECASE)
TESTING = re.compile(r'Iteration (\d+), Testing net \(#(\d+)\)')
TEST_OUTPUT = re.compile(r'Test net output #\d+: (\S+) = ' + _NUMBER, re.IGNORECASE)

TRAIN_COLUMNS = ['iteration', 'loss', 'lr']


def parse_lines(lines):
    """(train_rows, test_rows) from an iterable of log lines; see the module doc."""
    train, test = [], []
    testing = None          # the test row being filled, and its net index
    for line in lines:
        match = TRAIN_LOSS.search(line)
        if match:
            testing = None
            train.append({'iteration': int(match.group(1)), 'loss': float(match.group(2))})
            continue
        match = LEARNING_RATE.search(line)
        if match:
            testing = None
            iteration, rate = int(match.group(1)), float(match.group(2))
            if train and train[-1]['iteration'] == iteration and 'lr' not in train[-1]:
                train[-1]['lr'] = rate
            else:            # an lr line without its loss line (display on a different cycle)
                train.append({'iteration': iteration, 'lr': rate})
            continue
        match = TESTING.search(line)
        if match:
            testing = ({'iteration': int(match.group(1))}, int(match.group(2)))
            test.append(testing[0])
            continue
        match = TEST_OUTPUT.search(line)
        if match and testing is not None:
            row, net_index = testing
            name = match.group(1) if net_index == 0 else 'net%d_%s' % (net_index, match.group(1))
            row[_free_name(row, name)] = float(match.group(2))
    return train, test


def _free_name(row, name):
    if name not in row:
        return name
    k = 1
    while '%s_%d' % (name, k) in row:
        k += 1
    return '%s_%d' % (name, k)


def parse_log(path):
    """(train_rows, test_rows) of the log file at ``path``; CaffeError if it has neither."""
    path = os.fspath(path)
    try:
        with open(path, encoding='utf-8', errors='replace') as f:
            train, test = parse_lines(f)
    except OSError as exc:
        raise CaffeError('cannot read log %s: %s' % (path, exc.strerror)) from None
    if not train and not test:
        raise CaffeError("%s has no solver lines ('Iteration N, loss = x', 'Test net output "
                         "#k: name = y'); is it a Caffe training log?" % path)
    return train, test


def test_columns(test_rows):
    """'iteration' and then every test output name, in the order they first appear."""
    columns = ['iteration']
    for row in test_rows:
        columns.extend(name for name in row if name not in columns)
    return columns


def write_csv(path, rows, columns):
    """Write ``rows`` (dicts) as CSV with a header, atomically; a missing value is empty."""
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=columns, restval='', lineterminator='\n')
    writer.writeheader()
    for row in rows:
        writer.writerow({k: (repr(v) if isinstance(v, float) else v) for k, v in row.items()})
    with atomic_write(path) as f:
        f.write(text.getvalue().encode('utf-8'))


def read_csv(path):
    """The rows of a CSV written by write_csv, numbers as int/float and gaps as None."""
    with open(path, newline='', encoding='utf-8') as f:
        return [{k: _number(v) for k, v in row.items()} for row in csv.DictReader(f)]


def _number(text):
    if text == '':
        return None
    return int(text) if text.lstrip('-').isdigit() else float(text)


def _series(rows, name):
    points = [(row['iteration'], row[name]) for row in rows if row.get(name) is not None]
    return [p[0] for p in points], [p[1] for p in points]


def plot_curves(path, train_rows, test_rows, title=None):
    """A PNG (written atomically) with three panels against iteration: train loss and the
    test outputs named like a loss; the other test outputs (accuracy...); the learning rate."""
    try:
        import matplotlib
    except ImportError:
        raise CaffeError('the plot needs matplotlib (pip install matplotlib)') from None
    matplotlib.use('Agg')
    from matplotlib.figure import Figure  # no pyplot: no global figure state, no GUI backend
    figure = Figure(figsize=(8, 9))
    loss_axes, score_axes, lr_axes = figure.subplots(3, 1, sharex=True)
    iterations, losses = _series(train_rows, 'loss')
    if iterations:
        loss_axes.plot(iterations, losses, label='train loss', linewidth=1)
    outputs = test_columns(test_rows)[1:]
    for name in outputs:
        axes = loss_axes if 'loss' in name.lower() else score_axes
        xs, ys = _series(test_rows, name)
        axes.plot(xs, ys, marker='o', markersize=3, label='test ' + name)
    iterations, rates = _series(train_rows, 'lr')
    if iterations:
        lr_axes.plot(iterations, rates, color='tab:green', linewidth=1, drawstyle='steps-post')
    if rates and min(rates) > 0 and max(rates) > 10 * min(rates):
        lr_axes.set_yscale('log')
    for axes, label in ((loss_axes, 'loss'), (score_axes, 'test output'), (lr_axes, 'lr')):
        axes.set_ylabel(label)
        axes.grid(True, alpha=0.3)
        if axes.get_legend_handles_labels()[0]:
            axes.legend(loc='best', fontsize='small')
    if not outputs:
        score_axes.text(0.5, 0.5, 'no test outputs in the log', ha='center', va='center',
                        transform=score_axes.transAxes)
    lr_axes.set_xlabel('iteration')
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    with atomic_write(path) as f:
        figure.savefig(f, format='png', dpi=100)
