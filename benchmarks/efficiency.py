#!/usr/bin/env python3
"""Expected data-parallel efficiency on one node of 8 GPUs and on 2 nodes of 8, from a step
time measured on one GPU and the allreduce times of the links (docs/training.md, "Expected
efficiency": the same calculation, with measured figures in place of assumed ones).

    python benchmarks/efficiency.py --step-s 0.5 --params-mib 180 --batch-norms 100
        [--latency-us 15,40] [--bandwidth-gbs 150,12] [--bucket-mib 25]

--step-s is one GPU's forward-backward-update at its batch (benchmarks/train_gpu.py prints
it, and the params and batch norms of the net); --latency-us and --bandwidth-gbs are the
small-message allreduce time and the large-message bus bandwidth within a node and across
two (nccl-tests' all_reduce_perf measures both; the defaults are the document's NVLink and
100 Gb/s InfiniBand assumptions). On N GPUs a step takes T plus what does not overlap:
  - SyncBN: 2 allreduces per batch norm (forward statistics, backward sums) and one more,
    each a latency on the critical path;
  - gradients: a ring moves twice the gradients over the slowest link, overlapping the
    backward (taken as 65% of T) but for the last bucket, and for whatever the backward
    is too short to hide.
"""
import argparse
import sys

BACKWARD_SHARE = 0.65       # of a step: the backward, which the gradient allreduces overlap
GPUS_PER_NODE = 8
MIB = 1024.0 * 1024.0


def step_on_many(step_s, batch_norms, params_bytes, latency_s, bandwidth, bucket_bytes):
    """(seconds of a step on many GPUs, {part: seconds it adds}) for one link kind."""
    gradients = 2 * params_bytes / bandwidth
    added = {'syncbn': (2 * batch_norms + 1) * latency_s,
             'last bucket': 2 * min(bucket_bytes, params_bytes) / bandwidth,
             'unhidden gradients': max(0.0, gradients - BACKWARD_SHARE * step_s)}
    return step_s + sum(added.values()), added


def efficiency_lines(step_s, batch_norms, params_mib, latency_us=(15, 40),
                     bandwidth_gbs=(150, 12), bucket_mib=25):
    """The report: one node of 8 and two nodes of 8, as lines of text."""
    lines = ['one GPU: step %.1f ms; %d batch norms; %.1f MiB of gradients; allreduce latency '
             '%g/%g us, bandwidth %g/%g GB/s (within a node/across nodes); buckets %g MiB'
             % (step_s * 1e3, batch_norms, params_mib, latency_us[0], latency_us[1],
                bandwidth_gbs[0], bandwidth_gbs[1], bucket_mib)]
    steps = []
    for nodes, latency, bandwidth in zip((1, 2), latency_us, bandwidth_gbs):
        step, added = step_on_many(step_s, batch_norms, params_mib * MIB, latency * 1e-6,
                                   bandwidth * 1e9, bucket_mib * MIB)
        steps.append(step)
        gpus = nodes * GPUS_PER_NODE
        lines.append('%d node(s) x %d GPUs: step %.1f ms (+ %s): efficiency %.1f%%, %.1f '
                     "GPUs' worth" % (nodes, GPUS_PER_NODE, step * 1e3, ', '.join(
                         '%s %.1f ms' % (part, s * 1e3) for part, s in added.items()),
                         100 * step_s / step, gpus * step_s / step))
    lines.append('2 nodes against twice one node: %.1f%%' % (100 * steps[0] / steps[1]))
    return lines


def pair(text):
    values = [float(v) for v in text.split(',')]
    if len(values) != 2 or min(values) <= 0:
        raise argparse.ArgumentTypeError('expected two positive numbers A,B, got %r' % text)
    return values


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--step-s', type=float, required=True, help="one GPU's step, seconds")
    p.add_argument('--params-mib', type=float, default=260 / 1.048576,
                   help='float32 gradients, MiB (default: 65 M params)')
    p.add_argument('--batch-norms', type=int, default=100, help='SyncBN layers (default 100)')
    p.add_argument('--latency-us', type=pair, default=(15, 40), metavar='IN,ACROSS')
    p.add_argument('--bandwidth-gbs', type=pair, default=(150, 12), metavar='IN,ACROSS')
    p.add_argument('--bucket-mib', type=float, default=25, help='gradient bucket (default 25)')
    args = p.parse_args(argv)
    if args.step_s <= 0 or args.params_mib <= 0 or args.batch_norms < 0 or args.bucket_mib <= 0:
        p.error('--step-s, --params-mib and --bucket-mib must be positive, --batch-norms >= 0')
    print('\n'.join(efficiency_lines(args.step_s, args.batch_norms, args.params_mib,
                                     args.latency_us, args.bandwidth_gbs, args.bucket_mib)))
    return 0


if __name__ == '__main__':
    sys.exit(main())
