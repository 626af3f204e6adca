"""The emulated cluster: network namespaces with shaped links (netbed) and the time model that
projects measured steps to other links (timemodel)."""
