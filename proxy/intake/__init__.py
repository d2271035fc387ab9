"""The app's request as it comes in, as every shell needs it: who it is from
(:mod:`~proxy.intake.identity`), the upstream key it goes with (:mod:`~proxy.intake.keys`), the
memory it may take (:mod:`~proxy.intake.memory`: the gate every body, kept body and relayed
message draws from) and its body, read within its limits and deadlines as that memory allows
(:mod:`~proxy.intake.body`). Ingress, serve and upstream all take requests in, so this sits below
them.
"""
