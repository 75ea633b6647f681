"""File formats, and nothing else: binary and HDF5 caffemodels, .binaryproto blobs,
solverstates, and atomic writes. No Net and no conversion lives here."""
