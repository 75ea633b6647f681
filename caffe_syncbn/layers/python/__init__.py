"""Python: a layer whose class the prototxt names in a module of the user's."""
