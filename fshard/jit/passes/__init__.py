"""Inductor graph passes of ``fs.jit``: collective bucketing (:mod:`.bucket`, which also runs the
overlap scheduling), compute/communication overlap (:mod:`.overlap`), memory (:mod:`.memory`)."""
