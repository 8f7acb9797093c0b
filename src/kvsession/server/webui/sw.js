// Makes kvsession's web UI installable as an app. It intercepts nothing: the page is one small file, and the
// API's answers (streams the page may stop) always go straight to the server.
self.addEventListener("install", () => self.skipWaiting());
self.addEventListener("activate", (event) => event.waitUntil(self.clients.claim()));
