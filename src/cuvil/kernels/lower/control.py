"""No lowerings: If, Loop and Scan never reach the kernel layer. The frontend expands them on import into the
ops of their subgraphs (:mod:`cuvil.frontend.subgraphs`), which lower through their own families; the
rows of :data:`cuvil.kernels.support.EXPANDED_ON_IMPORT` say what each expansion needs. The two nodes of a
run-time loop (``LoopState``, ``LoopBack``) have no lowering either: the schedule makes their stages
(:mod:`cuvil.kernels.loops`)."""
