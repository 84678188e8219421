"""Pure decision logic: no sockets, no asyncio, no clocks, no side-effecting imports."""
