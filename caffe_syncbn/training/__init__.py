"""Training: Caffe's solver loop, its update rules and learning-rate policies, snapshots in
the terms of the user's prototxt, and data-parallel replication over devices and
processes."""
