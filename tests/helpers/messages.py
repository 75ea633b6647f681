"""The one-line errors the tests expect: bad input gets one line naming what it can."""
import pytest

from caffe_syncbn.errors import CaffeError


def one_line(message, *names):
    """``message``, checked to be one short line that names each of ``names``."""
    assert '\n' not in message and len(message) <= 300, message
    for name in names:
        assert str(name) in message, (name, message)
    return message


def error_of(function, *args, **kwargs):
    """The message of the CaffeError that ``function(*args, **kwargs)`` raises."""
    with pytest.raises(CaffeError) as info:
        function(*args, **kwargs)
    return str(info.value)
