"""Gradient averaging across replicas in buckets that overlap the backward pass.

A learnable param's gradient is final once the backward pass has gone through the layer
that owns it: a layer that shares it comes later in the net (Caffe requires the owner to
come first), so its backward has already run. The params are grouped, in the order in
which they become final, into buckets of about ``bucket_bytes``; a bucket's allreduce is
started (``comm.allreduce_async``: a helper thread for ThreadComm, a side stream for NCCL)
as soon as backward has passed its last owner, while the layers below it keep computing.
``finish`` waits for every bucket and writes the averages back into the diffs.

Every replica builds the same buckets and starts them in the same order, so the
collectives match. Each element is summed exactly as in one flat buffer, so the result
does not depend on the bucket size.
"""

DEFAULT_BUCKET_BYTES = 25 << 20


class _Bucket:
    def __init__(self):
        self.ready_at = None          # start once backward has finished this layer index
        self.params = []
        self.nbytes = 0
        self.flat = None
        self.handle = None


class GradientBuckets:
    """The gradient buckets of one replica's net (see the module docstring)."""

    def __init__(self, net, comm, bucket_bytes=DEFAULT_BUCKET_BYTES):
        self.comm = comm
        owner_layer = {}
        for index, layer in enumerate(net.layers):
            for blob in layer.blobs:
                owner_layer.setdefault(id(blob), index)
        # a param with lr_mult 0 (BN's running statistics) is never updated: nothing to reduce
        learned = [blob for blob, lr in zip(net.learnable_params, net.params_lr) if lr != 0]
        final_order = sorted(learned, key=lambda blob: -owner_layer[id(blob)])
        self.buckets = []
        for blob in final_order:
            if not self.buckets or self.buckets[-1].nbytes + blob.diff.nbytes > bucket_bytes:
                self.buckets.append(_Bucket())
            bucket = self.buckets[-1]
            bucket.params.append(blob)
            bucket.nbytes += blob.diff.nbytes
            # params come in decreasing owner order: the last one added has the lowest
            bucket.ready_at = owner_layer[id(blob)]
        self._next = 0

    def layer_done(self, index):
        """Backward has finished layer ``index`` (layers finish in decreasing order)."""
        while self._next < len(self.buckets) and self.buckets[self._next].ready_at >= index:
            self._start(self.buckets[self._next])
            self._next += 1

    def _start(self, bucket):
        xp = bucket.params[0].xp
        bucket.flat = xp.concatenate([blob.diff.ravel() for blob in bucket.params])
        bucket.handle = self.comm.allreduce_async(bucket.flat, tag='gradients')

    def finish(self):
        """Start what is left, wait for every bucket, and store sum / size in the diffs."""
        self.layer_done(-1)
        self._next = 0
        for bucket in self.buckets:
            bucket.handle.wait()
            flat = bucket.flat
            flat *= flat.dtype.type(1.0 / self.comm.size)
            offset = 0
            for blob in bucket.params:
                blob.diff[...] = flat[offset:offset + blob.count].reshape(blob.shape)
                offset += blob.count
            bucket.flat = bucket.handle = None
