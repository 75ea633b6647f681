"""Caffe's protobuf messages, a drop-in for pycaffe's ``caffe.proto.caffe_pb2``.

Not protoc output: the schema comes from ``caffe.pb`` next to this file (a
FileDescriptorSet built from ``proto/caffe.proto`` by ``tools/gen_proto.py``)
and is loaded into a private descriptor pool, so it cannot clash with another
``caffe.*`` schema (pycaffe, onnx converters, ...) in the same process, and it
works with any protobuf runtime from 4.21 on.

Every top-level message is a module attribute (``NetParameter``,
``LayerParameter``, ...), every top-level enum is an ``EnumTypeWrapper``
(``Phase``) and its values are module constants (``TRAIN``, ``TEST``), as in a
protoc-generated module.  Nested enums live on their message classes
(``PoolingParameter.MAX``, ``V1LayerParameter.CONVOLUTION``).
"""
import os as _os

from google.protobuf import descriptor_pb2 as _descriptor_pb2
from google.protobuf import descriptor_pool as _descriptor_pool
from google.protobuf import message_factory as _message_factory
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper

_SCHEMA = _os.path.join(_os.path.dirname(_os.path.abspath(__file__)), 'caffe.pb')


def _load_file(path):
    with open(path, 'rb') as f:
        files = _descriptor_pb2.FileDescriptorSet.FromString(f.read()).file
    pool = _descriptor_pool.DescriptorPool()
    for file_proto in files:
        pool.AddSerializedFile(file_proto.SerializeToString())
    return pool, pool.FindFileByName(files[-1].name)


_POOL, DESCRIPTOR = _load_file(_SCHEMA)

if hasattr(_message_factory, 'GetMessageClass'):  # protobuf >= 4.22
    _message_class = _message_factory.GetMessageClass
else:
    _message_class = _message_factory.MessageFactory(_POOL).GetPrototype

for _name, _desc in DESCRIPTOR.message_types_by_name.items():
    globals()[_name] = _message_class(_desc)
    globals()[_name].__module__ = __name__  # nicer repr, like protoc's classes

for _name, _desc in DESCRIPTOR.enum_types_by_name.items():
    globals()[_name] = _enum_type_wrapper.EnumTypeWrapper(_desc)
    for _value in _desc.values:
        globals()[_value.name] = _value.number

del _name, _desc, _value
