// Command client asks an external-snapshot-metadata sidecar for the
// allocated blocks of a VolumeSnapshot, or for the blocks that changed
// between two, as a backup tool does: over TLS, trusting the CA of the
// driver's SnapshotMetadataService, with a service account token for that
// service's audience. It prints one JSON object: the metadata type, the
// volume's capacity and every range, in the order the stream sent them.
// A refusal exits with status 1 and the gRPC code and message on stderr.
//
// test/e2e runs it against modeguard on the local cluster:
//
//	client -address 127.0.0.1:50051 -ca ca.pem -token-file token \
//	  -namespace ns -snapshot snap-2 [-base-snapshot-id <handle of snap-1>]
package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"github.com/kubernetes-csi/external-snapshot-metadata/pkg/api"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/status"
)

// Range is one range of bytes the sidecar reported.
type Range struct {
	Offset int64 `json:"offset"`
	Size   int64 `json:"size"`
}

// Result is what the client prints.
type Result struct {
	Type                string  `json:"type"`
	VolumeCapacityBytes int64   `json:"volumeCapacityBytes"`
	Ranges              []Range `json:"ranges"`
}

func main() {
	var (
		address    = flag.String("address", "", "the sidecar's address, host:port (the SnapshotMetadataService's spec.address)")
		caFile     = flag.String("ca", "", "PEM file of the CA that signed the sidecar's certificate (the SnapshotMetadataService's spec.caCert)")
		tokenFile  = flag.String("token-file", "", "file holding a service account token for the SnapshotMetadataService's spec.audience")
		namespace  = flag.String("namespace", "", "namespace of the VolumeSnapshots")
		snapshot   = flag.String("snapshot", "", "the VolumeSnapshot whose blocks are listed (the target of a delta)")
		baseID     = flag.String("base-snapshot-id", "", "with it, the blocks changed since this snapshot: the CSI snapshot handle of the base (its VolumeSnapshotContent's status.snapshotHandle)")
		maxResults = flag.Int("max-results", 0, "ranges per streamed message (0: the driver's default)")
		timeout    = flag.Duration("timeout", time.Minute, "for the whole call")
	)
	flag.Parse()
	if *address == "" || *caFile == "" || *tokenFile == "" || *namespace == "" || *snapshot == "" {
		fmt.Fprintln(os.Stderr, "client: -address, -ca, -token-file, -namespace and -snapshot are required")
		os.Exit(2)
	}
	res, err := run(*address, *caFile, *tokenFile, *namespace, *snapshot, *baseID, int32(*maxResults), *timeout)
	if err != nil {
		if s, ok := status.FromError(err); ok {
			fmt.Fprintf(os.Stderr, "code=%s message=%s\n", s.Code(), s.Message())
		} else {
			fmt.Fprintln(os.Stderr, err)
		}
		os.Exit(1)
	}
	if err := json.NewEncoder(os.Stdout).Encode(res); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}

func run(address, caFile, tokenFile, namespace, snapshot, baseID string, maxResults int32, timeout time.Duration) (*Result, error) {
	caPEM, err := os.ReadFile(caFile)
	if err != nil {
		return nil, err
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(caPEM) {
		return nil, fmt.Errorf("%s: no PEM certificate", caFile)
	}
	token, err := os.ReadFile(tokenFile)
	if err != nil {
		return nil, err
	}
	conn, err := grpc.NewClient(address, grpc.WithTransportCredentials(credentials.NewTLS(&tls.Config{
		RootCAs:    pool,
		MinVersion: tls.VersionTLS12,
	})))
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	c := api.NewSnapshotMetadataClient(conn)
	tok := strings.TrimSpace(string(token))

	// Both streams send the same three fields; recv reads one message.
	type message interface {
		GetBlockMetadataType() api.BlockMetadataType
		GetVolumeCapacityBytes() int64
		GetBlockMetadata() []*api.BlockMetadata
	}
	var recv func() (message, error)
	if baseID == "" {
		s, err := c.GetMetadataAllocated(ctx, &api.GetMetadataAllocatedRequest{
			SecurityToken: tok, Namespace: namespace, SnapshotName: snapshot, MaxResults: maxResults,
		})
		if err != nil {
			return nil, err
		}
		recv = func() (message, error) { return s.Recv() }
	} else {
		s, err := c.GetMetadataDelta(ctx, &api.GetMetadataDeltaRequest{
			SecurityToken: tok, Namespace: namespace, BaseSnapshotId: baseID, TargetSnapshotName: snapshot, MaxResults: maxResults,
		})
		if err != nil {
			return nil, err
		}
		recv = func() (message, error) { return s.Recv() }
	}
	res := &Result{Ranges: []Range{}}
	for {
		m, err := recv()
		if errors.Is(err, io.EOF) {
			return res, nil
		}
		if err != nil {
			return nil, err
		}
		res.Type = m.GetBlockMetadataType().String()
		res.VolumeCapacityBytes = m.GetVolumeCapacityBytes()
		for _, b := range m.GetBlockMetadata() {
			res.Ranges = append(res.Ranges, Range{Offset: b.GetByteOffset(), Size: b.GetSizeBytes()})
		}
	}
}
