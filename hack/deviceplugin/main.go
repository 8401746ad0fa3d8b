// Command weightlift-gpu-plugin is a kubelet device plugin that advertises N fake GPUs (default
// resource nvidia.com/gpu) on a machine that has none, so worker pods' GPU requests schedule
// and are allocated by the kubelet's device manager as on a GPU node. It speaks the kubelet's
// device-plugin API (k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1): serve DevicePlugin on a
// socket in the kubelet's device-plugins dir, Register with kubelet.sock, and register again
// whenever the kubelet restarts (it removes every plugin socket when it does).
//
// Built by hack/build-node.sh inside the k8s.io/kubernetes wrapper module (same grpc, same API).
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

type plugin struct {
	pluginapi.UnimplementedDevicePluginServer
	devices []*pluginapi.Device
}

func (p *plugin) GetDevicePluginOptions(context.Context, *pluginapi.Empty) (*pluginapi.DevicePluginOptions, error) {
	return &pluginapi.DevicePluginOptions{}, nil
}

// ListAndWatch sends the (fixed, always healthy) device list once and holds the stream open.
func (p *plugin) ListAndWatch(_ *pluginapi.Empty, s grpc.ServerStreamingServer[pluginapi.ListAndWatchResponse]) error {
	if err := s.Send(&pluginapi.ListAndWatchResponse{Devices: p.devices}); err != nil {
		return err
	}
	<-s.Context().Done()
	return nil
}

func (p *plugin) GetPreferredAllocation(context.Context, *pluginapi.PreferredAllocationRequest) (*pluginapi.PreferredAllocationResponse, error) {
	return &pluginapi.PreferredAllocationResponse{}, nil
}

// Allocate answers as NVIDIA's plugin does with its envvar strategy: the container learns its
// devices from NVIDIA_VISIBLE_DEVICES (no device nodes: there are none).
func (p *plugin) Allocate(_ context.Context, req *pluginapi.AllocateRequest) (*pluginapi.AllocateResponse, error) {
	out := &pluginapi.AllocateResponse{}
	for _, c := range req.ContainerRequests {
		ids := strings.Join(c.DevicesIds, ",")
		out.ContainerResponses = append(out.ContainerResponses, &pluginapi.ContainerAllocateResponse{
			Envs: map[string]string{"NVIDIA_VISIBLE_DEVICES": ids, "WEIGHTLIFT_FAKE_GPUS": ids},
		})
	}
	return out, nil
}

func (p *plugin) PreStartContainer(context.Context, *pluginapi.PreStartContainerRequest) (*pluginapi.PreStartContainerResponse, error) {
	return &pluginapi.PreStartContainerResponse{}, nil
}

func dial(ctx context.Context, path string) (*grpc.ClientConn, error) {
	return grpc.NewClient("unix://"+path, grpc.WithTransportCredentials(insecure.NewCredentials()))
}

// serve starts the plugin's gRPC server on sock and registers it with the kubelet.
func serve(dir, sock, resource string, p *plugin) (*grpc.Server, error) {
	_ = os.Remove(sock)
	lis, err := net.Listen("unix", sock)
	if err != nil {
		return nil, err
	}
	srv := grpc.NewServer()
	pluginapi.RegisterDevicePluginServer(srv, p)
	go func() { _ = srv.Serve(lis) }()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	conn, err := dial(ctx, filepath.Join(dir, "kubelet.sock"))
	if err != nil {
		srv.Stop()
		return nil, err
	}
	defer conn.Close()
	_, err = pluginapi.NewRegistrationClient(conn).Register(ctx, &pluginapi.RegisterRequest{
		Version:      pluginapi.Version,
		Endpoint:     filepath.Base(sock),
		ResourceName: resource,
		Options:      &pluginapi.DevicePluginOptions{},
	})
	if err != nil {
		srv.Stop()
		return nil, err
	}
	return srv, nil
}

func main() {
	dir := flag.String("dir", pluginapi.DevicePluginPath, "the kubelet's device-plugins dir")
	resource := flag.String("resource", "nvidia.com/gpu", "extended resource name")
	count := flag.Int("count", 8, "devices to advertise")
	flag.Parse()

	p := &plugin{}
	for i := 0; i < *count; i++ {
		p.devices = append(p.devices, &pluginapi.Device{ID: fmt.Sprintf("fake-gpu-%d", i), Health: pluginapi.Healthy})
	}
	sock := filepath.Join(*dir, "weightlift-gpu.sock")
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)

	var srv *grpc.Server
	tick := time.NewTicker(500 * time.Millisecond)
	defer tick.Stop()
	for {
		// (Re-)register when our socket is gone: the kubelet removed it on its (re)start.
		if _, err := os.Stat(sock); err != nil || srv == nil {
			if srv != nil {
				srv.Stop()
				srv = nil
			}
			if _, err := os.Stat(filepath.Join(*dir, "kubelet.sock")); err == nil {
				s, err := serve(*dir, sock, *resource, p)
				if err != nil {
					log.Printf("register with the kubelet: %v (retrying)", err)
				} else {
					srv = s
					log.Printf("registered %d x %s on %s", *count, *resource, sock)
				}
			}
		}
		select {
		case <-stop:
			if srv != nil {
				srv.Stop()
			}
			_ = os.Remove(sock)
			return
		case <-tick.C:
		}
	}
}
