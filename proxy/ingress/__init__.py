"""Where a request is served: the API listener, handing a connection to its owner, forwarding to the
owning process or replica, and the supervisor of workers.
"""
