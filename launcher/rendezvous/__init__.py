"""The rendezvous: etcd, its key layout and the job's membership, rounds and leases."""
