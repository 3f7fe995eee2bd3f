"""The built-in jobs, each written against :mod:`elastic.job`'s contract as a user's would be.

They are the ImageNet classifier (:mod:`.imagenet`, ``job=imagenet``, the default) and a small
language model on generated token sequences (:mod:`.lm`, ``job=lm``)."""
