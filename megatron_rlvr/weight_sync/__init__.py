"""Learner → engines weight sync: flattened dtype buckets, one broadcast each, versioned,
checksummed, followed by a logprob parity probe."""
