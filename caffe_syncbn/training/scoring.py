"""What a solver reports, a part of it (solver.py): Caffe's test nets, each running
``test_iter`` batches on the train net's weights (stop and snapshot requests are taken
between batches), the loss smoothed over ``average_loss`` iterations, and the nets'
outputs, as Caffe logs them."""
import logging

import numpy as np

from ..backend import to_numpy
from ..backend.one_caller import one_at_a_time

log = logging.getLogger('caffe_syncbn')


class Scoring:
    """The tests and logs of a Solver (a mixin: it uses the solver's param, nets, dtype,
    requests and snapshots)."""

    @one_at_a_time('test_all')
    def test_all(self):
        """Run every test net; returns one {output name: mean value} per test net."""
        results = []
        for i in range(len(self.test_nets)):
            if self.requested_early_exit:
                break
            results.append(self.test(i))
        return results

    def test(self, test_net_id=0):
        log.info('Iteration %d, Testing net (#%d)', self.iter, test_net_id)
        net = self.test_nets[test_net_id]
        net.share_weights_with(self.net)
        iters = self.param.test_iter[test_net_id]
        d = self.dtype.type
        sums, loss = None, d(0)
        for _ in range(iters):
            request = self.requested_action()
            while request is not None:
                if request in ('snapshot', 'snapshot_stop'):
                    self.snapshot()
                if request in ('stop', 'snapshot_stop'):
                    self.requested_early_exit = True
                request = self.requested_action()
            if self.requested_early_exit:
                log.info('Test interrupted.')
                return None
            batch_loss, outputs = self.on_net_device(lambda: self._test_batch(net, test_net_id))
            if self.param.test_compute_loss:
                loss += d(batch_loss)
            sums = outputs if sums is None else {k: sums[k] + v for k, v in outputs.items()}
        if self.param.test_compute_loss:
            log.info('Test loss: %g', loss / d(max(iters, 1)))
        means = {k: v / d(iters) for k, v in (sums or {}).items()}
        self.log_outputs(net, 'Test', means)
        return {k: (v.item() if v.size == 1 else v) for k, v in means.items()}

    def _test_batch(self, net, test_net_id):
        """One batch of a test net: its loss and {output name: host array}."""
        self.feed(net, test_net_id)
        loss = net.forward_prefilled()
        return loss, {name: to_numpy(net.blobs[name].data).astype(self.dtype)
                      for name in net.outputs}

    def _update_smoothed_loss(self, loss, start_iter):
        d = self.dtype.type
        average, loss = self.param.average_loss, d(loss)
        if len(self._losses) < average:
            self._losses.append(loss)
            n = len(self._losses)
            self.smoothed_loss = float((d(self.smoothed_loss) * d(n - 1) + loss) / d(n))
        else:
            slot = (self.iter - start_iter) % average
            self.smoothed_loss = float(d(self.smoothed_loss) + (loss - self._losses[slot]) / d(average))
            self._losses[slot] = loss

    def log_outputs(self, net, which, values=None):
        """Caffe's '    Train net output #k: name = v (* w = w*v loss)' lines."""
        d = self.dtype.type
        index = 0
        for name in net.outputs:
            weight = net.output_blob_loss_weights.get(name, 0)
            data = values[name] if values is not None else to_numpy(net.blobs[name].data)
            for value in np.asarray(data, self.dtype).ravel():
                extra = ' (* %g = %g loss)' % (weight, d(weight) * value) if weight else ''
                log.info('    %s net output #%d: %s = %g%s', which, index, name, value, extra)
                index += 1
