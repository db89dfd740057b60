"""`longstride check`: is longstride's attention exact for a user's model and data, on one device and under CP."""
