"""The package's layering, as docs/architecture.md states it: every import of a package
module goes to a lower floor (or stays in its own room), no import is hidden inside a
function, nothing imports in a circle, and no module is past 450 lines."""
import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / 'caffe_syncbn'
MAX_LINES = 450


def floors():
    """{room: floor} from the floor table of docs/architecture.md: a room is a module
    (`net`) or a package (`layers/`) of caffe_syncbn."""
    table = {}
    for line in (ROOT / 'docs' / 'architecture.md').read_text().splitlines():
        match = re.match(r'\|\s*(\d+)\s*\|([^|]*)\|', line)
        if match:
            for room in re.findall(r'`([\w./]+)`', match.group(2)):
                table[room.rstrip('/')] = int(match.group(1))
    return table


def modules():
    """{module name: path} of every module of the package."""
    found = {}
    for path in PACKAGE.rglob('*.py'):
        parts = path.relative_to(ROOT).with_suffix('').parts
        if parts[-1] == '__init__':
            parts = parts[:-1]
        found['.'.join(parts)] = path
    return found


def room_of(module):
    """The room of a module: its sub-package under caffe_syncbn, or the module itself."""
    parts = module.split('.')
    return parts[1] if len(parts) > 1 else '__init__'


def imports(module, path):
    """(imported package module, line, whether at the top level of the file)."""
    tree = ast.parse(path.read_text())
    top = set()
    for node in tree.body:       # a guard for an optional dependency (try/if) counts as top level
        top.update(id(n) for n in ([node] + (node.body if isinstance(node, (ast.Try, ast.If)) else [])))
    is_package = path.name == '__init__.py'
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split('.')[:len(module.split('.')) - node.level + is_package]
                target = '.'.join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ''
            names = [target + '.' + alias.name for alias in node.names]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        for name in names:
            while name and name not in MODULES:
                name = name.rpartition('.')[0]
            if name.startswith('caffe_syncbn'):
                yield name, node.lineno, id(node) in top


MODULES = modules()
FLOORS = floors()


def test_the_floor_table_names_every_room():
    rooms = {room_of(m) for m in MODULES}
    assert rooms - set(FLOORS) == set(), 'rooms missing from docs/architecture.md'
    assert set(FLOORS) - rooms == set(), 'docs/architecture.md names rooms that do not exist'


@pytest.mark.parametrize('module', sorted(MODULES))
def test_imports_go_down_the_floors(module):
    room = room_of(module)
    for target, line, at_top in imports(module, MODULES[module]):
        where = '%s:%d imports %s' % (MODULES[module].relative_to(ROOT), line, target)
        assert at_top, where + ' inside a function: imports go at the top of the file'
        if room_of(target) != room and target != 'caffe_syncbn':
            assert FLOORS[room_of(target)] < FLOORS[room], where + ', a floor that is not below'


def test_every_room_is_a_package_that_setup_py_finds():
    """find_packages skips a folder without __init__.py: its modules would not install."""
    folders = {path.parent for path in PACKAGE.rglob('*.py')}
    assert [str(f) for f in folders if not (f / '__init__.py').exists()] == []


def test_no_import_circles():
    graph = {m: {t for t, _, _ in imports(m, p) if t != m} for m, p in MODULES.items()}
    state = {}

    def visit(module, trail):
        state[module] = 'open'
        for target in sorted(graph[module]):
            if state.get(target) == 'open':
                cycle = trail[trail.index(target):] + [target]
                pytest.fail('import circle: ' + ' -> '.join(cycle))
            if target not in state:
                visit(target, trail + [target])
        state[module] = 'done'

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


@pytest.mark.parametrize('module', sorted(MODULES))
def test_modules_stay_short(module):
    lines = len(MODULES[module].read_text().splitlines())
    assert lines <= MAX_LINES, '%s has %d lines' % (module, lines)


def test_a_planted_circle_and_an_upward_import_are_caught(tmp_path, monkeypatch):
    """The checks above can fail: an upward import is found, and so is a circle."""
    upward = [(t, at_top) for t, _, at_top in
              imports('caffe_syncbn.layer', _fake(tmp_path, 'from .net import Net\n'))]
    assert upward == [('caffe_syncbn.net', True)]
    assert FLOORS[room_of('caffe_syncbn.net')] > FLOORS[room_of('caffe_syncbn.layer')]
    nested = list(imports('caffe_syncbn.net', _fake(tmp_path, 'def f():\n    from . import layer\n')))
    assert nested == [('caffe_syncbn.layer', 2, False)]


def _fake(tmp_path, text):
    path = tmp_path / 'module.py'
    path.write_text(text)
    return path
