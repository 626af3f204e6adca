"""DES sub-operators, communicators and the identity-gradient allreduce."""
from des_ops.comm import (Communicator, HorovodCommunicator, InProcessWorld, LocalCommunicator,
                          Mpi4pyCommunicator, allreduce_sum, default_communicator)

__all__ = ["Communicator", "HorovodCommunicator", "InProcessWorld", "LocalCommunicator",
           "Mpi4pyCommunicator", "allreduce_sum", "default_communicator"]
