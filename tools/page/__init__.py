"""The page's browser helpers: headless Chromium and a live server (browser.py, for the page's tests), and its screenshots (screenshots.py)."""
