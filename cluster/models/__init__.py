"""Model folders loopserve makes or converts itself (nothing downloaded at run time)."""
