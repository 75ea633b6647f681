"""Built-in layers, one package per family. Importing this package imports every module of
every family, which registers their layer types."""
import importlib
import pkgutil

for _module in pkgutil.walk_packages(__path__, __name__ + '.'):
    importlib.import_module(_module.name)
