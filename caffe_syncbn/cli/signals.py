"""Signals while train runs, and how the run ends: SIGINT, SIGHUP and SIGTERM become
requests the solver reads between iterations and test batches (Solver.action_request),
and the exit status says what ended the run.

SIGTERM is what SLURM (at a time limit, or scancel) and Kubernetes send before SIGKILL,
30 s later by default (KillWait, terminationGracePeriodSeconds). It asks a process to end,
so its ``snapshot`` effect is a snapshot and then the end of the run; SIGHUP's trains on.
"""
import logging
import signal
import time

log = logging.getLogger('caffe_syncbn')

#: the exit status of a run that -nan_effect stop ended
EXIT_NON_FINITE = 3
#: ... and of one that SIGTERM ended: 128 + its number, as a shell reports a process that
#: the signal killed, so that a scheduler's requeue logic reads it as such
EXIT_SIGTERM = 128 + signal.SIGTERM
#: the seconds between SIGTERM and SIGKILL under SLURM's and Kubernetes' defaults
SIGTERM_GRACE_SECONDS = 30


class SignalRequests:
    """The requests of SIGINT, SIGHUP and SIGTERM (the module docstring); an effect of
    ``none`` catches the signal and ignores it, as Caffe does. The previous handlers come
    back on close."""

    def __init__(self, sigint_effect, sighup_effect, sigterm_effect):
        self.pending = None
        self.effects = {signal.SIGINT: sigint_effect, signal.SIGHUP: sighup_effect,
                        signal.SIGTERM: {'snapshot': 'snapshot_stop'}.get(sigterm_effect,
                                                                         sigterm_effect)}
        #: when the first SIGTERM that asked for something came (time.monotonic), or None
        self.sigterm_at = None
        #: whether the request ``take`` returned last answers a SIGTERM
        self.sigterm_taken = False
        self._sigterm_pending = False
        self._previous = {signum: signal.signal(signum, self._handle) for signum in self.effects}

    def _handle(self, signum, frame):
        if self.effects[signum] == 'none':
            return
        self.pending = self.effects[signum]
        if signum == signal.SIGTERM:
            self._sigterm_pending = True
            if self.sigterm_at is None:
                self.sigterm_at = time.monotonic()

    def take(self):
        """The request pending, or None (``sigterm_taken`` says whether SIGTERM asked)."""
        request, self.pending = self.pending, None
        self.sigterm_taken = self._sigterm_pending and request is not None
        if self.sigterm_taken:
            self._sigterm_pending = False
        return request

    def close(self):
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


def log_sigterm(solver, request, waited):
    """The line of a SIGTERM that the run acts on, ``waited`` seconds after it came, and a
    warning where the run may not end before SIGKILL."""
    log.info('SIGTERM came %.1f s ago; after iteration %d the run %s', waited, solver.iter,
             'snapshots, then stops' if request == 'snapshot_stop' else 'stops')
    last = solver.last_snapshot_seconds
    if waited + (last or 0) > SIGTERM_GRACE_SECONDS:
        log.warning('The run may not end within the %d s between SIGTERM and SIGKILL (SLURM '
                    "KillWait, Kubernetes' terminationGracePeriodSeconds): %.1f s since "
                    'SIGTERM%s', SIGTERM_GRACE_SECONDS, waited,
                    ', and the last snapshot took %.1f s' % last if last else '')


def exit_status(solver, requests):
    """0 for a run done, or ended by SIGINT or SIGHUP as in Caffe; EXIT_NON_FINITE for one
    that -nan_effect stop ended; EXIT_SIGTERM for one that SIGTERM ended, logging how long
    the end took after the signal (a warning past SIGTERM_GRACE_SECONDS)."""
    if solver.stopped_on_non_finite:
        return EXIT_NON_FINITE
    if requests is None or requests.sigterm_at is None or not solver.requested_early_exit:
        return 0
    took = time.monotonic() - requests.sigterm_at
    (log.warning if took > SIGTERM_GRACE_SECONDS else log.info)(
        'Stopped %.1f s after SIGTERM (SIGKILL follows it after %d s by default)', took,
        SIGTERM_GRACE_SECONDS)
    return EXIT_SIGTERM
