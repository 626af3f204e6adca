"""DES sub-operators, communicators and the identity-gradient allreduce.

The names below load des_ops.comm and des_ops.mpi (and TensorFlow) on first use, so that importing a light
module of this package (des_ops.wire) does not load TensorFlow.
"""
__all__ = ["Communicator", "HorovodCommunicator", "InProcessWorld", "LocalCommunicator",
           "Mpi4pyCommunicator", "allreduce_sum", "default_communicator"]


def __getattr__(name: str):
    if name in __all__:
        from des_ops import comm, mpi
        return getattr(mpi if hasattr(mpi, name) and not hasattr(comm, name) else comm, name)
    raise AttributeError(name)
