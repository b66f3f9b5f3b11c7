"""Pure code more than one service runs (no grpc, no servicers): a service may import
from here and from mesh/, never from another service's package."""
