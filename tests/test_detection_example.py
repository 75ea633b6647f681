"""The detection example (examples/detection/): its dataset and a few iterations of both
runs, as a smoke test; the full runs are for the README's numbers, not for the tests."""
import json
import pathlib
import sys

import numpy as np

from caffe_syncbn.data.annotation import annotation_rows, parse_annotated_datum
from caffe_syncbn.data.datum import LMDBReader, datum_to_array

EXAMPLE = pathlib.Path(__file__).parent.parent / 'examples' / 'detection'
sys.path.insert(0, str(EXAMPLE))

import make_shapes  # noqa: E402
import train  # noqa: E402


def test_shapes_dataset_boxes_fit_their_shapes(tmp_path):
    train_db, test_db = make_shapes.make_dataset(str(tmp_path), train=6, test=2,
                                                 log=lambda *a: None)
    records = list(LMDBReader(train_db).records())
    assert len(records) == 6 and len(list(LMDBReader(test_db).records())) == 2
    for _, value in records:
        record = parse_annotated_datum(value)
        image = datum_to_array(record.datum)
        rows = annotation_rows(record)
        assert image.shape == (3, 64, 64) and 1 <= len(rows) <= 3
        assert set(rows[:, 0]) <= {1, 2, 3}
        for row in rows:   # every box holds its shape: its pixels differ from the noise
            x0, y0, x1, y1 = np.round(row[2:6] * 64).astype(int)
            assert x1 - x0 >= 12 and y1 - y0 >= 12


def test_both_runs_train_and_report_a_map(tmp_path):
    make_shapes.make_dataset(str(tmp_path), train=16, test=8, log=lambda *a: None)
    results = train.run(str(tmp_path), iters=3, test_images=8, log=lambda *a: None)
    assert set(results) == {'syncbn', 'per-device-bn'}
    for result in results.values():
        assert np.isfinite(result['final_loss']) and 0 <= result['mAP'] <= 1
    assert json.loads((tmp_path / 'results.json').read_text()).keys() == results.keys()
