"""What a worker imports: the runtime around a job, and the contracts shared with its agent.

The communicator, state, checkpoints, LR policy, sampler and the trainer live here. The launcher
reads the contracts (config, control messages, events) and a few helpers from here, never the
other way round. See ARCHITECTURE.md for how the parts fit together."""
