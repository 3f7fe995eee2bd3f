"""The library that workers and agents import: rendezvous, communicator, state, checkpoints,
LR policy, sampler and the trainer. See ARCHITECTURE.md for how the parts fit together."""
