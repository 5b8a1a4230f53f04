package metrics

import (
	"context"
	"errors"
	"net"
	"net/http"
	"time"

	"k8s.io/klog/v2"
)

// Path is where the metrics are served.
const Path = "/metrics"

// Server serves the metrics over HTTP at Path.
type Server struct {
	http *http.Server
	lis  net.Listener
	done chan struct{}
}

// Start listens on addr (host:port; port 0 picks a free one) and serves the
// metrics there in the background until Shutdown.
func (m *Metrics) Start(addr string) (*Server, error) {
	lis, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, err
	}
	mux := http.NewServeMux()
	mux.Handle(Path, m.Handler())
	s := &Server{
		http: &http.Server{
			Handler:           mux,
			ReadHeaderTimeout: 10 * time.Second,
			ReadTimeout:       30 * time.Second,
			WriteTimeout:      time.Minute,
			IdleTimeout:       2 * time.Minute,
		},
		lis:  lis,
		done: make(chan struct{}),
	}
	go func() {
		defer close(s.done)
		if err := s.http.Serve(lis); err != nil && !errors.Is(err, http.ErrServerClosed) {
			klog.ErrorS(err, "Serving metrics stopped", "address", lis.Addr().String())
		}
	}()
	return s, nil
}

// Addr is the address the server listens on.
func (s *Server) Addr() net.Addr { return s.lis.Addr() }

// URL is where a scraper finds the metrics.
func (s *Server) URL() string { return "http://" + s.lis.Addr().String() + Path }

// Shutdown stops accepting scrapes and waits, until ctx ends, for those in
// flight.
func (s *Server) Shutdown(ctx context.Context) error {
	err := s.http.Shutdown(ctx)
	if err != nil {
		s.http.Close()
	}
	<-s.done
	return err
}
